"""Settings: parsing of every textual form, validation with errors that name the field."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.api import settings as settings_module
from phalanx.api.errors import ConfigError, PhalanxError
from phalanx.api.settings import (
    AgentSettings,
    HeartbeatSettings,
    MasterSettings,
    ProbeSettings,
    RendezvousSettings,
    describe,
    env_names,
    from_env,
    from_mapping,
    parse_duration,
    parse_node_range,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("500ms", 0.5),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1.5", 1.5),
        (".25s", 0.25),
        (7, 7.0),
        ("1h30m", 5400.0),
        ("2m5s", 125.0),
        ("1h0m0.5s", 3600.5),
        ("1s500ms", 1.5),
    ],
)
def test_parse_duration_accepts_the_documented_forms(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10 parsecs", "-3s", "1d", True, "1h 30m", "1h-30m", "m30"])
def test_parse_duration_rejects_garbage_naming_the_field(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^hang\.floor_s: "):
        parse_duration(text, name="hang.floor_s")


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_parse_duration_of_a_plain_number_is_seconds(value: float) -> None:
    assert parse_duration(f"{value!r}") == pytest.approx(value)


@pytest.mark.parametrize(("text", "expected"), [("1", (1, 1)), ("2:4", (2, 4)), ("3:3", (3, 3))])
def test_parse_node_range(text: str, expected: tuple[int, int]) -> None:
    assert parse_node_range(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("0", "at least 1"), ("4:2", "below the minimum"), ("a:b", "MIN:MAX"), ("1:2:3", "MIN:MAX")],
)
def test_parse_node_range_errors_say_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_node_range(text)


def test_defaults_are_valid_and_frozen() -> None:
    settings = MasterSettings(job_id="demo")
    assert settings.heartbeat.interval_s == 1.0
    assert settings.heartbeat.timeout_s == 10.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.job_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"min_nodes": 0}, "min_nodes", "at least 1"),
        ({"min_nodes": 3, "max_nodes": 2}, "max_nodes", "at least min_nodes"),
        ({"min_nodes": 3, "max_nodes": 3, "unit": 2}, "unit", "no multiple of unit=2"),
        ({"last_call_s": -1.0}, "last_call_s", "negative"),
    ],
)
def test_rendezvous_validation(kwargs: dict[str, int], field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        RendezvousSettings(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_heartbeat_timeout_floor_and_ratio() -> None:
    assert HeartbeatSettings(interval_s=0.5, timeout_s=2.0).timeout_s == 2.0
    with pytest.raises(ConfigError, match="at least 2s"):
        HeartbeatSettings(timeout_s=1.0)
    with pytest.raises(ConfigError, match="twice interval_s"):
        HeartbeatSettings(interval_s=3.0, timeout_s=5.0)


@pytest.mark.parametrize("job_id", ["", "UPPER", "-lead", "trail-", "a" * 64, "under_score"])
def test_job_id_must_be_a_dns_label(job_id: str) -> None:
    with pytest.raises(ConfigError, match="job_id"):
        MasterSettings(job_id=job_id)


def test_from_mapping_nested_and_typed() -> None:
    settings = from_mapping(
        MasterSettings,
        {
            "job_id": "j1",
            "grpc_port": "5000",
            "heartbeat": {"timeout_s": "5s"},
            "rendezvous": {"max_nodes": 4},
        },
    )
    assert settings.grpc_port == 5000
    assert settings.heartbeat.timeout_s == 5.0
    assert settings.rendezvous.max_nodes == 4


def test_from_mapping_rejects_unknown_keys_naming_them() -> None:
    with pytest.raises(
        ConfigError, match=r"heartbeat\.timeout: unknown setting; known ones are interval_s, timeout_s"
    ):
        from_mapping(MasterSettings, {"job_id": "j1", "heartbeat": {"timeout": 5}})


def test_from_mapping_reports_nested_validation_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"^heartbeat\.timeout_s: must be at least 2s") as info:
        from_mapping(MasterSettings, {"job_id": "j1", "heartbeat": {"timeout_s": "1s"}})
    assert info.value.field == "heartbeat.timeout_s"


@pytest.mark.parametrize(
    ("raw", "message"),
    [({"grpc_port": "http"}, "expected an integer"), ({"grpc_port": 70000}, "between 0 and 65535")],
)
def test_from_mapping_type_errors(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(MasterSettings, {"job_id": "j1", **raw})


def test_from_env_maps_groups_to_prefixed_names() -> None:
    env = {
        "PHALANX_JOB_ID": "train-1",
        "PHALANX_NPROC_PER_NODE": "4",
        "PHALANX_HANG_FLOOR_S": "90s",
        "PHALANX_HANG_ENABLED": "false",
        "UNRELATED": "x",
    }
    settings = from_env(AgentSettings, env)
    assert settings.job_id == "train-1"
    assert settings.nproc_per_node == 4
    assert settings.hang.floor_s == 90.0
    assert settings.hang.enabled is False


def test_from_env_bad_boolean_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"hang\.enabled: expected true or false"):
        from_env(AgentSettings, {"PHALANX_HANG_ENABLED": "maybe"})


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        ("matmul,allgather", ("matmul", "allgather")),
        ("allgather, matmul", ("matmul", "allgather")),  # always sent in the same order
        ("allgather", ("allgather",)),
        ("matmul,matmul", ("matmul",)),
    ],
)
def test_probe_kinds_parse_into_a_fixed_order(text: str, kinds: tuple[str, ...]) -> None:
    assert ProbeSettings(kinds=text).kind_names == kinds


def test_probe_kinds_default_to_every_kind() -> None:
    assert ProbeSettings().kind_names == ("matmul", "allgather")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ping", r"^kinds: unknown probe kind 'ping'; choose from matmul, allgather \(comma-separated\)$"),
        ("matmul;allgather", r"unknown probe kind 'matmul;allgather'; choose from matmul, allgather"),
        ("", r"^kinds: name at least one probe kind of matmul, allgather"),
        (" , ", r"name at least one probe kind of matmul, allgather \(comma-separated\), got ' , '"),
    ],
)
def test_probe_kinds_errors_name_the_field_and_the_allowed_values(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        ProbeSettings(kinds=text)
    assert info.value.field == "kinds"


def test_probe_kinds_from_env_name_the_nested_field() -> None:
    env = {"PHALANX_JOB_ID": "j1", "PHALANX_PROBES_KINDS": "allgather"}
    assert from_env(MasterSettings, env).probes.kind_names == ("allgather",)
    with pytest.raises(ConfigError, match=r"^probes\.kinds: unknown probe kind 'gemm'"):
        from_env(MasterSettings, {**env, "PHALANX_PROBES_KINDS": "gemm"})


def test_every_field_documents_itself() -> None:
    names = env_names(MasterSettings) | env_names(AgentSettings)
    assert "PHALANX_HEARTBEAT_TIMEOUT_S" in names
    assert "PHALANX_CHECKPOINT_KEEP_LAST" in names
    for name, doc in names.items():
        assert doc, name
        assert not doc.startswith(" "), name
    timeout = next(f for f in dataclasses.fields(HeartbeatSettings) if f.name == "timeout_s")
    assert describe(timeout) == "Silence after which the master declares a node lost. [s] (default 10.0)"


def test_config_error_is_a_phalanx_error_and_a_value_error() -> None:
    error = ConfigError("must be positive", field="x")
    assert isinstance(error, PhalanxError)
    assert isinstance(error, ValueError)
    assert str(error) == "x: must be positive"


# ------------------------------------------------------------------------------------------------------
# Non-finite numbers: refused in every float setting of every group, whichever way it was given.


@functools.cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _groups() -> list[type]:
    return [
        obj
        for obj in vars(settings_module).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__name__.endswith("Settings")
    ]


def _float_fields() -> list[tuple[type, str]]:
    return [
        (cls, f.name) for cls in _groups() for f in dataclasses.fields(cls) if _hints(cls)[f.name] is float
    ]


def _root_and_path(cls: type, name: str) -> tuple[type, list[str]] | None:
    """The top-level settings class holding ``cls`` and the path to its field ``name``, if any holds it."""
    for root in (MasterSettings, AgentSettings, settings_module.OperatorSettings):
        if root is cls:
            return root, [name]
        for f in dataclasses.fields(root):
            sub = _hints(root)[f.name]
            if sub is cls:
                return root, [f.name, name]
            if dataclasses.is_dataclass(sub):
                for g in dataclasses.fields(sub):
                    if _hints(sub)[g.name] is cls:
                        return root, [f.name, g.name, name]
    return None


def test_every_settings_group_has_float_fields_to_check() -> None:
    assert len(_groups()) >= 12
    assert len(_float_fields()) >= 20


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused_in_every_float_setting_built_in_code(value: float) -> None:
    for cls, name in _float_fields():
        with pytest.raises(ConfigError, match=rf"^{name}: must be a finite number, got (nan|inf|-inf)"):
            cls(**{name: value})


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"])
def test_non_finite_numbers_are_refused_from_flags_env_and_specs_naming_the_setting(text: str) -> None:
    checked = 0
    for cls, name in _float_fields():
        found = _root_and_path(cls, name)
        if found is None:
            continue
        root, path = found
        tree: dict[str, object] = {}
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})  # type: ignore[assignment]
        node[path[-1]] = text
        job_id = {"job_id": "j"} if "job_id" in {f.name for f in dataclasses.fields(root)} else {}
        tree.update(job_id)
        dotted = ".".join(path)
        with pytest.raises(ConfigError, match=rf"^{dotted}: ") as err:
            from_mapping(root, tree)
        assert "finite" in str(err.value) or "expected" in str(err.value), str(err.value)
        env = {"PHALANX_" + "_".join(path).upper(): text}
        with pytest.raises(ConfigError, match=rf"^{dotted}: "):
            from_env(root, {**env, **{"PHALANX_JOB_ID": v for v in job_id.values()}})
        checked += 1
    assert checked >= 19  # JobPodSettings is built by the operator from the CRD only (tested above)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "1e999", "inf"])
def test_parse_duration_refuses_non_finite_values(value: float | str) -> None:
    with pytest.raises(ConfigError, match=r"^hang-floor: "):
        parse_duration(value, name="hang-floor")


def test_an_integer_setting_given_infinity_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"^rendezvous.min_nodes: expected an integer"):
        from_mapping(MasterSettings, {"job_id": "j", "rendezvous": {"min_nodes": math.inf}})


def test_the_operators_trust_switches_are_operator_settings_and_the_safe_value_is_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cordon_nodes, network_policy and monitoring_namespace live in OperatorSettings: one table gives
    their PHALANX_OPERATOR_* variables (which the chart sets), their flags and their docs. Cordoning is off
    and the NetworkPolicies are on unless the administrator says otherwise."""
    from phalanx.cli.main import build_parser
    from phalanx.cli.operator import settings_from

    shipped = settings_module.OperatorSettings()
    assert (shipped.cordon_nodes, shipped.network_policy, shipped.monitoring_namespace) == (
        False, True, "monitoring",
    )  # fmt: skip
    names = env_names(settings_module.OperatorSettings, prefix="PHALANX_OPERATOR_")
    assert "spec.cordonBadNodes" in names["PHALANX_OPERATOR_CORDON_NODES"]
    assert {"PHALANX_OPERATOR_NETWORK_POLICY", "PHALANX_OPERATOR_MONITORING_NAMESPACE"} <= names.keys()
    for name in ("PHALANX_OPERATOR_CORDON_NODES", "PHALANX_OPERATOR_NETWORK_POLICY"):
        monkeypatch.setenv(name, "true")
    monkeypatch.setenv("PHALANX_OPERATOR_MONITORING_NAMESPACE", "prom")
    on = settings_from(build_parser().parse_args(["operator"]))
    assert (on.cordon_nodes, on.network_policy, on.monitoring_namespace) == (True, True, "prom")
    flagged = settings_from(build_parser().parse_args(["operator", "--cordon-nodes", "false"]))
    assert flagged.cordon_nodes is False, "a flag overrides the environment"
    monkeypatch.setenv("PHALANX_OPERATOR_NETWORK_POLICY", "false")
    assert settings_from(build_parser().parse_args(["operator"])).network_policy is False
    monkeypatch.setenv("PHALANX_OPERATOR_CORDON_NODES", "maybe")
    with pytest.raises(ConfigError, match="cordon_nodes"):
        settings_from(build_parser().parse_args(["operator"]))
