"""spec.healthChecks -> the master's probe settings: defaults, the CRD's defaults, errors naming the spec;
spec.suspend; the run policy (activeDeadline, ttlAfterFinished); durations as the CRD admits them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from phalanx.api.errors import ConfigError
from phalanx.api.settings import ProbeSettings, parse_duration
from phalanx.operator.admission import DURATION_RE, MAX_DURATIONS, MAX_NODES, MAX_NPROC_PER_NODE
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


def test_confirm_rounds_reach_the_straggler_settings() -> None:
    probes = parse_spec(spec(healthChecks={"enabled": True, "confirmRounds": 3})).probes
    assert probes.stragglers.confirm_rounds == 3
    assert parse_spec(spec()).probes.stragglers.confirm_rounds == 2


def test_the_slow_node_policy_reaches_the_straggler_settings() -> None:
    assert parse_spec(spec(healthChecks={"evictSlowNodes": True})).probes.stragglers.evict_slow_nodes
    assert not parse_spec(spec()).probes.stragglers.evict_slow_nodes


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
        ({"evictSlowNodes": "yes"}, r"spec\.healthChecks\.evictSlowNodes: expected true or false, got 'yes'"),
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
    kubernetes = parse_spec(spec(gangScheduling={"enabled": True})).gang
    assert kubernetes is not None
    assert (kubernetes.scheduler, kubernetes.scheduler_name) == ("kubernetes", "")
    cosched = parse_spec(spec(gangScheduling={"enabled": True, "scheduler": "coscheduling"})).gang
    assert cosched is not None
    assert (cosched.scheduler, cosched.scheduler_name) == ("coscheduling", "scheduler-plugins-scheduler")


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
        (
            {"enabled": True, "scheduler": "volcano"},
            r"spec\.gangScheduling\.scheduler: must be one of kubernetes, coscheduling, got 'volcano'",
        ),
        ({"enabled": True, "schedulerName": 3}, r"spec\.gangScheduling\.schedulerName: expected a string"),
    ],
)
def test_invalid_gang_scheduling_names_the_field(gang: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec(spec(gangScheduling=gang))


# ------------------------------------------------------------------------------------------------------
# Bounds: every count, size and duration has a maximum, in the CRD and again in the operator


def _integers(node: dict[str, Any], path: str = "spec") -> list[tuple[str, dict[str, Any]]]:
    """Every integer property of the spec schema, with its path."""
    found = []
    if node.get("type") == "integer":
        found.append((path, node))
    for key, child in (node.get("properties") or {}).items():
        found += _integers(child, f"{path}.{key}")
    return found


KUBERNETES_TYPES = ("spec.template.spec.", "spec.master.template.spec.")


def test_every_count_of_the_crd_has_a_maximum() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    # The Pod templates' fields are Kubernetes' own (pod_schema.json): the API server bounds them on the Pods.
    counts = [(path, prop) for path, prop in _integers(schema) if not path.startswith(KUBERNETES_TYPES)]
    assert len(counts) >= 12
    unbounded = [path for path, prop in counts if "maximum" not in prop]
    assert unbounded == []


def test_every_duration_of_the_crd_has_a_maximum() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    durations = []
    for key, prop in schema["properties"].items():
        children = prop.get("properties") or {key: prop}
        for child, leaf in children.items():
            rules = leaf.get("x-kubernetes-validations") or []
            if any(DURATION_RE in r["rule"] for r in rules):
                durations.append((key, child, rules))
    assert len(durations) == len(MAX_DURATIONS)
    for key, child, rules in durations:
        assert any("duration(self) <= duration(" in r["rule"] for r in rules), (key, child)


def test_the_defaults_lie_within_the_bounds() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for path, prop in _integers(schema):
        if "default" in prop:
            assert prop["default"] <= prop["maximum"], path
    parse_spec(spec())  # every default duration passes its bound


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"nodes": {"min": 1, "max": 2147483647}}, "spec.nodes.max", f"at most {MAX_NODES}, got 2147483647"),
        ({"nodes": {"min": 6000, "max": 6000}}, "spec.nodes.min", f"at most {MAX_NODES}"),
        ({"nodes": {"min": 1, "max": "many"}}, "spec.nodes.max", "expected a whole number"),
        ({"nodes": {"min": 1.5, "max": 2}}, "spec.nodes.min", "expected a whole number"),
        ({"nprocPerNode": 1000}, "spec.nprocPerNode", f"at most {MAX_NPROC_PER_NODE}"),
        ({"parallelism": {"tensor": 10**6}}, "spec.parallelism.tensor", "at most 4096"),
        ({"restart": {"maxRestarts": 10**9}}, "spec.restart.maxRestarts", "at most 10000"),
        ({"checkpoint": {"keepLast": 10**6}}, "spec.checkpoint.keepLast", "at most 1000"),
        ({"hang": {"factor": 1e9}}, "spec.hang.factor", "at most 1000"),
        ({"heartbeat": {"interval": "2h", "timeout": "5h"}}, "spec.heartbeat.interval", "at most 1m"),
        ({"activeDeadline": "100000h"}, "spec.activeDeadline", "at most 8760h"),
        ({"sharedMemory": {"sizeLimit": "5Ti"}}, "spec.sharedMemory.sizeLimit", "at most 4Ti"),
    ],
)
def test_a_spec_past_a_bound_is_refused_by_the_operator_too(
    fields: dict[str, Any], field: str, message: str
) -> None:
    """An object that slipped past admission (created before the CRD had these bounds) fails with the field
    named, before anything is allocated for it."""
    with pytest.raises(ConfigError) as exc:
        parse_spec(spec(**fields))
    assert field in str(exc.value)
    assert message in str(exc.value)


def test_a_template_too_large_to_copy_for_every_node_is_refused_with_what_to_do() -> None:
    """40,000 tolerations (1.4 MB): before, the operator built nodes.max copies of it in one pass."""
    tolerations = [{"key": f"k{i}", "operator": "Exists"} for i in range(40_000)]
    big = spec()
    big["template"]["spec"]["tolerations"] = tolerations
    with pytest.raises(
        ConfigError, match=r"^spec\.template: is \d+ KiB as JSON, at most 256 KiB: .*ConfigMap"
    ):
        parse_spec(big)
    with pytest.raises(ConfigError, match=r"^spec\.master\.template: is \d+ KiB"):
        parse_spec(spec(master={"template": {"spec": {"tolerations": tolerations}}}))
    fits = spec()
    fits["template"]["spec"]["tolerations"] = tolerations[:1000]  # about 40 KiB
    assert parse_spec(fits).template["spec"]["tolerations"] == tolerations[:1000]
