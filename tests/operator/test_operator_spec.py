"""spec.healthChecks -> the master's probe settings: defaults, the CRD's defaults, errors naming the spec;
spec.suspend; the run policy (activeDeadline, ttlAfterFinished); durations as the CRD admits them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from phalanx.api.errors import ConfigError
from phalanx.api.settings import ProbeSettings, parse_duration
from phalanx.operator.crd import DURATION_RE, build_crd
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


def test_confirm_rounds_reach_the_straggler_settings() -> None:
    probes = parse_spec(spec(healthChecks={"enabled": True, "confirmRounds": 3})).probes
    assert probes.stragglers.confirm_rounds == 3
    assert parse_spec(spec()).probes.stragglers.confirm_rounds == 2


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
        ({"confirmRounds": 0}, r"spec\.healthChecks\.confirmRounds: must be greater than 0"),
        ({"confirmRounds": "2"}, r"spec\.healthChecks\.confirmRounds: expected a whole number, got '2'"),
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


def test_run_policy_is_absent_by_default() -> None:
    parsed = parse_spec(spec())
    assert (parsed.active_deadline_s, parsed.ttl_after_finished_s) == (None, None)
    parsed = parse_spec(spec(activeDeadline="", ttlAfterFinished=""))
    assert (parsed.active_deadline_s, parsed.ttl_after_finished_s) == (None, None), "empty: not set"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("24h", 86400.0), ("1h30m", 5400.0), ("1.5h", 5400.0), ("90s", 90.0), ("500ms", 0.5)],
)
def test_run_policy_durations_in_seconds(text: str, seconds: float) -> None:
    parsed = parse_spec(spec(activeDeadline=text, ttlAfterFinished=text))
    assert (parsed.active_deadline_s, parsed.ttl_after_finished_s) == (seconds, seconds)


def test_a_zero_ttl_deletes_at_once_but_a_zero_deadline_is_refused() -> None:
    assert parse_spec(spec(ttlAfterFinished="0s")).ttl_after_finished_s == 0.0
    with pytest.raises(
        ConfigError,
        match=r"^spec\.activeDeadline: must be greater than 0, got '0s'; leave it out for no deadline",
    ):
        parse_spec(spec(activeDeadline="0s"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"activeDeadline": "a day"},
            r"^spec\.activeDeadline: expected a duration such as 500ms, 30s, 2m or 1h",
        ),
        ({"activeDeadline": "1d"}, r"^spec\.activeDeadline: expected a duration .*got '1d'"),
        ({"activeDeadline": True}, r"^spec\.activeDeadline: expected a duration"),
        ({"ttlAfterFinished": "forever"}, r"^spec\.ttlAfterFinished: expected a duration .*got 'forever'"),
        ({"ttlAfterFinished": "-1s"}, r"^spec\.ttlAfterFinished: expected a duration"),
    ],
)
def test_invalid_run_policy_names_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec(spec(**fields))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30.0), ("1h30m", 5400.0), ("2m5s", 125.0), ("1h0m0.5s", 3600.5), ("0.5m", 30.0)],
)
def test_what_admission_takes_parse_spec_takes_too(text: str, seconds: float) -> None:
    """A duration the CRD admits (its pattern takes Go's compound form) parses to Go's seconds, so the API
    server never takes a job that parse_spec then fails as InvalidSpec."""
    assert re.match(DURATION_RE, text)
    assert parse_duration(text, name="x") == pytest.approx(seconds)


def test_compound_durations_work_for_every_spec_duration() -> None:
    parsed = parse_spec(spec(heartbeat={"interval": "1s", "timeout": "1m30s"}))
    assert parsed.heartbeat.timeout_s == 90.0


def test_gang_scheduling_is_off_by_default_and_its_minimum_follows_nodes_min() -> None:
    assert parse_spec(spec()).gang_min_nodes is None
    assert parse_spec(spec(gangScheduling={"enabled": False, "minNodes": 3})).gang_min_nodes is None
    assert parse_spec(spec(gangScheduling={"enabled": True})).gang_min_nodes == 2
    assert parse_spec(spec(gangScheduling={"enabled": True, "minNodes": 3})).gang_min_nodes == 3


@pytest.mark.parametrize(
    ("gang", "message"),
    [
        ({"enabled": "yes"}, r"spec\.gangScheduling\.enabled: expected true or false, got 'yes'"),
        (
            {"enabled": True, "minNodes": 4},
            r"spec\.gangScheduling\.minNodes: must be a whole number from 1 "
            r"to nodes\.max \(3\), got 4",
        ),
        ({"enabled": True, "minNodes": 0}, r"spec\.gangScheduling\.minNodes: .* got 0"),
        ({"enabled": True, "minNodes": True}, r"spec\.gangScheduling\.minNodes: .* got True"),
    ],
)
def test_invalid_gang_scheduling_names_the_field(gang: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec(spec(gangScheduling=gang))
