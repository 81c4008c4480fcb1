"""spec.healthChecks -> the master's probe settings: defaults, the CRD's defaults, errors naming the spec;
spec.suspend."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.api.errors import ConfigError
from phalanx.api.settings import ProbeSettings
from phalanx.operator.crd import build_crd
from phalanx.operator.spec import parse_spec


def spec(**fields: Any) -> dict[str, Any]:
    return {
        "nodes": {"min": 2, "max": 3},
        "template": {"spec": {"containers": [{"name": "t", "command": ["python", "train.py"]}]}},
        **fields,
    }


def test_no_health_checks_means_no_probe_rounds() -> None:
    probes = parse_spec(spec()).probes
    assert probes == ProbeSettings()
    assert (probes.enabled, probes.on_round_complete, probes.interval_s) == (False, False, 0.0)


def test_the_crds_default_group_parses_like_an_absent_one() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    default = schema["properties"]["spec"]["properties"]["healthChecks"]["default"]
    assert parse_spec(spec(healthChecks=default)).probes == ProbeSettings()


def test_enabled_probes_after_every_rendezvous_round_and_every_interval() -> None:
    health = {"enabled": True, "probes": ["allgather"], "interval": "10m", "timeout": "30s"}
    probes = parse_spec(spec(healthChecks=health)).probes
    assert probes.enabled
    assert probes.on_round_complete  # as training starts or resumes
    assert probes.interval_s == 600.0
    assert probes.timeout_s == 30.0
    assert probes.kind_names == ("allgather",)


def test_enabled_alone_keeps_every_other_default() -> None:
    probes = parse_spec(spec(healthChecks={"enabled": True})).probes
    assert probes == ProbeSettings(enabled=True, on_round_complete=True)
    assert probes.kind_names == ("matmul", "allgather")


@pytest.mark.parametrize(
    ("health", "message"),
    [
        ({"probes": ["ping"]}, r"spec\.healthChecks\.probes: unknown probe kind 'ping'; choose from matmul"),
        ({"probes": []}, r"spec\.healthChecks\.probes: expected a list of one or more of matmul, allgather"),
        ({"probes": "matmul"}, r"spec\.healthChecks\.probes: expected a list"),
        ({"timeout": "0s"}, r"spec\.healthChecks\.timeout: must be greater than 0"),
        ({"interval": "often"}, r"spec\.healthChecks\.interval: expected a duration such as 500ms"),
    ],
)
def test_invalid_health_checks_name_the_spec_field(health: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec(spec(healthChecks=health))


def test_suspend_defaults_to_false_and_takes_only_booleans() -> None:
    assert parse_spec(spec()).suspend is False
    assert parse_spec(spec(suspend=True)).suspend is True
    with pytest.raises(ConfigError, match=r"spec\.suspend: expected true or false, got 'false'"):
        parse_spec(spec(suspend="false"))
