"""Settings: one model that CLI flags, environment variables and the ElasticJob spec all map onto.

Settings are grouped, frozen dataclasses. Every field is declared with :func:`setting`, which records a
one-line doc and the unit; that metadata is the single source for ``--help`` texts, the environment
variable names and the CRD field descriptions. Defaults live here and nowhere else.

Validation happens in ``__post_init__`` and raises :class:`~phalanx.api.errors.ConfigError` naming the
field, so a bad flag, variable or spec field gets one clear sentence saying what to fix.

Environment variables are ``PHALANX_<GROUP>_<FIELD>`` in upper case, for example
``PHALANX_HEARTBEAT_TIMEOUT_S=5`` for ``MasterSettings.heartbeat.timeout_s``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from phalanx.api import limits
from phalanx.api.errors import ConfigError

T = TypeVar("T")

ENV_PREFIX = "PHALANX_"


def setting(default: Any, *, doc: str, unit: str = "") -> Any:
    """Declares a settings field with its default, a one-line doc and its unit."""
    return field(default=default, metadata={"doc": doc, "unit": unit})


def group(factory: Any, *, doc: str) -> Any:
    """Declares a nested settings group."""
    return field(default_factory=factory, metadata={"doc": doc, "unit": ""})


# ------------------------------------------------------------------------------------------------------
# Parsers for the textual forms used by flags, environment variables and the CRD.

_DURATION = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
# Go's compound form, which the CRD admits too: "1h30m", "2m0.5s".
_COMPOUND_DURATION = re.compile(r"^(?:[0-9]+(?:[.][0-9]+)?(?:ms|s|m|h))+$")
_DURATION_PART = re.compile(r"([0-9]+(?:[.][0-9]+)?)(ms|s|m|h)")


def parse_duration(text: str | float | int, *, name: str = "duration") -> float:
    """Parses ``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``, Go's compound form (``"1h30m"``) or a plain number
    of seconds."""
    if isinstance(text, bool):
        raise ConfigError(f"expected a duration such as 30s, got {text!r}", field=name)
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = _DURATION.match(text)
        if match:
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        elif _COMPOUND_DURATION.match(text.strip()):
            parts = _DURATION_PART.findall(text)
            seconds = sum(float(n) * _DURATION_UNITS[unit] for n, unit in parts)
        else:
            raise ConfigError(f"expected a duration such as 500ms, 30s, 2m or 1h, got {text!r}", field=name)
    if not math.isfinite(seconds):
        raise ConfigError(f"a duration must be a finite number of seconds, got {text!r}", field=name)
    if seconds < 0:
        raise ConfigError(f"a duration cannot be negative, got {text!r}", field=name)
    return seconds


def parse_node_range(text: str, *, name: str = "nnodes") -> tuple[int, int]:
    """Parses torchrun's ``--nnodes`` form: ``"N"`` or ``"MIN:MAX"``."""
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError(text)
    except ValueError as exc:
        raise ConfigError(f"expected N or MIN:MAX (e.g. 2:4), got {text!r}", field=name) from exc
    if low < 1:
        raise ConfigError(f"the minimum number of nodes must be at least 1, got {low}", field=name)
    if high < low:
        raise ConfigError(f"the maximum ({high}) is below the minimum ({low})", field=name)
    return low, high


def _convert(value: Any, target: Any, name: str) -> Any:
    """Converts a flag/env/spec value to the field's declared type."""
    if target is bool:
        if isinstance(value, bool):
            return value
        lowered = str(value).strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"expected true or false, got {value!r}", field=name)
    if target is int:
        if isinstance(value, bool):
            raise ConfigError(f"expected an integer, got {value!r}", field=name)
        try:
            return int(value)
        except (TypeError, ValueError, OverflowError) as exc:  # int(inf) overflows
            raise ConfigError(f"expected an integer, got {value!r}", field=name) from exc
    if target is float:
        if name.endswith("_s"):
            return parse_duration(value, name=name)
        try:
            return float(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"expected a number, got {value!r}", field=name) from exc
    if target is str:
        return str(value)
    raise ConfigError(f"cannot set a field of type {target!r} from text", field=name)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    resolved: dict[str, Any] = {}
    for name, hint in hints.items():
        if isinstance(hint, types.UnionType):  # `str | None` and the like: take the non-None member
            resolved[name] = next(a for a in typing.get_args(hint) if a is not type(None))
        else:
            resolved[name] = hint
    return resolved


def _is_group(hint: Any) -> typing.TypeGuard[type]:
    """True for a nested settings group (a dataclass type), false for scalar fields."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def from_mapping(cls: type[T], values: Mapping[str, Any], *, where: str = "") -> T:
    """Builds a settings object from a (possibly nested) mapping of field names to raw values.

    Unknown keys are an error naming the key, so a typo never silently falls back to a default.
    """
    hints = _field_types(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, raw in values.items():
        path = f"{where}{key}"
        if key not in known:
            raise ConfigError(f"unknown setting; known ones are {', '.join(sorted(known))}", field=path)
        target = hints[key]
        if _is_group(target):
            if not isinstance(raw, Mapping):
                raise ConfigError("expected a group of settings", field=path)
            kwargs[key] = from_mapping(target, raw, where=f"{path}.")
        else:
            kwargs[key] = _convert(raw, target, path)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if where and exc.field and not exc.field.startswith(where):
            raise ConfigError(str(exc).split(": ", 1)[-1], field=f"{where}{exc.field}") from exc
        raise


def from_env(cls: type[T], env: Mapping[str, str], *, prefix: str = ENV_PREFIX) -> T:
    """Builds settings from ``PHALANX_<GROUP>_<FIELD>`` variables; absent variables keep defaults."""
    return from_mapping(cls, _env_values(cls, env, prefix))


def _env_values(cls: type, env: Mapping[str, str], prefix: str) -> dict[str, Any]:
    hints = _field_types(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name.upper()}"
        target = hints[f.name]
        if _is_group(target):
            nested = _env_values(target, env, f"{name}_")
            if nested:
                values[f.name] = nested
        elif name in env:
            values[f.name] = env[name]
    return values


def env_names(cls: type, *, prefix: str = ENV_PREFIX) -> dict[str, str]:
    """Maps every environment variable a settings class reads to its doc line."""
    hints = _field_types(cls)
    names: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name.upper()}"
        target = hints[f.name]
        if _is_group(target):
            names.update(env_names(target, prefix=f"{name}_"))
        else:
            names[name] = describe(f)
    return names


def describe(f: dataclasses.Field[Any]) -> str:
    """The doc line of a field with its unit and default, for help texts and CRD descriptions."""
    doc = str(f.metadata.get("doc", ""))
    unit = f.metadata.get("unit")
    default = f.default if f.default is not dataclasses.MISSING else None
    tail = f" [{unit}]" if unit else ""
    if default not in (None, ""):
        tail += f" (default {default})"
    return doc + tail


PROBE_KINDS = ("matmul", "allgather")
"""Probe kinds the master can ask nodes to run, in the order a probe round sends them."""


def parse_probe_kinds(text: str, *, name: str = "kinds") -> tuple[str, ...]:
    """Parses ``"matmul,allgather"`` into kinds in :data:`PROBE_KINDS` order; repeats count once."""
    given = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [kind for kind in given if kind not in PROBE_KINDS]
    allowed = ", ".join(PROBE_KINDS)
    if unknown:
        names = ", ".join(repr(kind) for kind in unknown)
        raise ConfigError(f"unknown probe kind {names}; choose from {allowed} (comma-separated)", field=name)
    if not given:
        raise ConfigError(
            f"name at least one probe kind of {allowed} (comma-separated), got {text!r}", field=name
        )
    return tuple(kind for kind in PROBE_KINDS if kind in given)


def _refuse_non_finite(obj: Any) -> None:
    """nan passes every bound check (``nan < 0`` and ``nan > 0`` are both false) and inf passes every lower
    bound, then poisons what the setting feeds: a timer that never fires, a median that is nan."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"must be a finite number, got {value}", field=f.name)


def _checked(cls: type[T]) -> type[T]:
    """Every settings group carries this decorator (above ``@dataclass``): its float settings must be finite
    before its own checks run, however it was built (flags, environment, the CRD, or code)."""
    own = cls.__dict__.get("__post_init__")

    def __post_init__(self: Any) -> None:
        _refuse_non_finite(self)
        if own is not None:
            own(self)

    cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
    return cls


def _positive(value: float, name: str) -> None:
    if value <= 0:
        raise ConfigError(f"must be greater than 0, got {value}", field=name)


# ------------------------------------------------------------------------------------------------------
# Groups


@_checked
@dataclass(frozen=True, kw_only=True)
class RendezvousSettings:
    """How nodes form a round."""

    min_nodes: int = setting(1, doc="Fewest nodes a round may start with.")
    max_nodes: int = setting(
        1, doc="Most nodes a round takes; a round completes at once when this many joined."
    )
    unit: int = setting(1, doc="Membership is cut to a multiple of this many nodes.")
    last_call_s: float = setting(
        1.0, doc="Wait for more joiners after min_nodes joined before completing a round.", unit="s"
    )
    min_nodes_timeout_s: float = setting(
        600.0, doc="How long the job may have fewer than min_nodes nodes before it fails.", unit="s"
    )

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ConfigError(f"must be at least 1, got {self.min_nodes}", field="min_nodes")
        if self.max_nodes < self.min_nodes:
            raise ConfigError(
                f"max_nodes ({self.max_nodes}) must be at least min_nodes ({self.min_nodes})",
                field="max_nodes",
            )
        if self.unit < 1:
            raise ConfigError(f"must be at least 1, got {self.unit}", field="unit")
        if self.max_nodes // self.unit * self.unit < self.min_nodes:
            raise ConfigError(
                f"no multiple of unit={self.unit} lies between min_nodes={self.min_nodes} and "
                f"max_nodes={self.max_nodes}; change one of them",
                field="unit",
            )
        if self.last_call_s < 0:
            raise ConfigError(f"cannot be negative, got {self.last_call_s}", field="last_call_s")
        _positive(self.min_nodes_timeout_s, "min_nodes_timeout_s")


@_checked
@dataclass(frozen=True, kw_only=True)
class HeartbeatSettings:
    """Liveness of nodes."""

    interval_s: float = setting(1.0, doc="How often an agent sends a heartbeat.", unit="s")
    timeout_s: float = setting(10.0, doc="Silence after which the master declares a node lost.", unit="s")

    def __post_init__(self) -> None:
        _positive(self.interval_s, "interval_s")
        if self.timeout_s < 2.0:
            raise ConfigError(f"must be at least 2s, got {self.timeout_s}s", field="timeout_s")
        if self.timeout_s < 2 * self.interval_s:
            raise ConfigError(
                f"must be at least twice interval_s ({self.interval_s}s), got {self.timeout_s}s",
                field="timeout_s",
            )


@_checked
@dataclass(frozen=True, kw_only=True)
class HangSettings:
    """Hang detection from progress beacons and interval recorders: a rank is hung when it shows no progress
    (its beacon, or its recorder's newest record or oldest pending device work) for longer than
    ``max(floor_s, factor * p99 of its recent step intervals)`` while it waits in a recorded collective or on
    the GPU, and ``max(idle_floor_s, factor * p99)`` anywhere else (between collectives, or without the
    recorder), where a healthy rank may be saving a checkpoint or evaluating."""

    enabled: bool = setting(True, doc="Detect hung workers from stale progress beacons.")
    floor_s: float = setting(
        10.0,
        doc="Shortest time a rank may wait in a recorded collective, or on GPU work, before it counts as "
        "hung.",
        unit="s",
    )
    idle_floor_s: float = setting(
        60.0,
        doc="Shortest time a rank may show no progress outside any recorded collective (or without the "
        "interval recorder, from its beacon alone) before it counts as hung.",
        unit="s",
    )
    factor: float = setting(3.0, doc="Multiple of the p99 step interval after which a beacon is stale.")
    startup_s: float = setting(
        600.0,
        doc="How long a worker may run before its first reported step without counting as hung.",
        unit="s",
    )

    def __post_init__(self) -> None:
        _positive(self.floor_s, "floor_s")
        _positive(self.idle_floor_s, "idle_floor_s")
        if self.factor < 1:
            raise ConfigError(f"must be at least 1, got {self.factor}", field="factor")
        _positive(self.startup_s, "startup_s")


@_checked
@dataclass(frozen=True, kw_only=True)
class RestartSettings:
    """Budgets for restarting workers and replacing nodes."""

    max_restarts: int = setting(3, doc="Worker restarts (in place) the job may use before it fails.")
    max_evictions: int = setting(3, doc="Nodes the job may evict and replace before it fails.")
    grace_period_s: float = setting(
        5.0, doc="Time workers get between SIGTERM and SIGKILL when they are stopped.", unit="s"
    )

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"cannot be negative, got {self.max_restarts}", field="max_restarts")
        if self.max_evictions < 0:
            raise ConfigError(f"cannot be negative, got {self.max_evictions}", field="max_evictions")
        if self.grace_period_s < 0:
            raise ConfigError(f"cannot be negative, got {self.grace_period_s}", field="grace_period_s")


@_checked
@dataclass(frozen=True, kw_only=True)
class LogSettings:
    """Worker log shipping and the master's log buffers."""

    max_line_bytes: int = setting(4096, doc="Longer worker output lines are truncated to this.", unit="bytes")
    max_lines_per_s: int = setting(2000, doc="Lines per second a node may ship; excess lines are counted.")
    ring_lines: int = setting(2000, doc="Lines the master keeps per node and rank.")

    def __post_init__(self) -> None:
        for name in ("max_line_bytes", "max_lines_per_s", "ring_lines"):
            _positive(getattr(self, name), name)


@_checked
@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    """Flash checkpoint cadence and storage."""

    memory_interval_steps: int = setting(1, doc="Save to shared memory every this many steps.")
    persist_interval_steps: int = setting(100, doc="Persist to storage every this many steps (0: never).")
    storage_path: str = setting(
        "",
        doc="Where checkpoints are persisted: a directory, or s3://BUCKET/PREFIX (S3 or an S3-compatible "
        "store, configured by the standard AWS_* variables); empty: none.",
    )
    keep_last: int = setting(2, doc="Committed steps kept on storage.")

    def __post_init__(self) -> None:
        _positive(self.memory_interval_steps, "memory_interval_steps")
        if self.persist_interval_steps < 0:
            raise ConfigError(
                f"cannot be negative, got {self.persist_interval_steps}", field="persist_interval_steps"
            )
        _positive(self.keep_last, "keep_last")


@_checked
@dataclass(frozen=True, kw_only=True)
class StragglerSettings:
    """Fault isolation from health probes and step times (:mod:`phalanx.diagnostics.stragglers`).

    Every threshold is relative to the cluster's own median, so the verdicts do not depend on the
    hardware generation: a node is slow only compared with its peers.
    """

    compute_threshold: float = setting(
        0.8, doc="A node whose slowest device multiplies matrices below this fraction of the median is slow."
    )
    link_threshold: float = setting(
        0.8, doc="A probe pair whose all-gather bandwidth is below this fraction of the median is slow."
    )
    confirm_rounds: int = setting(
        2,
        doc="Probe rounds in a row that must find a node slow before it is evicted (a failed probe needs no "
        "confirmation); the confirming rounds start at once. 1: the first verdict evicts.",
    )
    step_factor: float = setting(
        1.5, doc="A rank whose median step interval exceeds this multiple of the ranks' median lags."
    )
    step_window: int = setting(32, doc="Most recent step intervals per rank the step-time check looks at.")
    step_min_samples: int = setting(
        5, doc="Step intervals a rank needs in the window before it can be judged."
    )
    step_check_interval_s: float = setting(
        10.0,
        doc="How often the master looks at the ranks' step intervals and scores the nodes (0: never); a lag "
        "starts a probe round.",
        unit="s",
    )
    step_confirm_checks: int = setting(
        3,
        doc="Step-time checks in a row that must find a node slower than step_factor times the other nodes' "
        "median before it is reported as a straggler (and evicted with evict_slow_nodes).",
    )
    evict_slow_nodes: bool = setting(
        False,
        doc="Evict a node that the step-time checks confirm slow, without waiting for a probe round (through "
        "the eviction budget). Off: it is only reported.",
    )

    def __post_init__(self) -> None:
        for name in ("compute_threshold", "link_threshold"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ConfigError(f"must be between 0 and 1 (exclusive), got {value}", field=name)
        if self.step_check_interval_s < 0:
            raise ConfigError(
                f"cannot be negative, got {self.step_check_interval_s}", field="step_check_interval_s"
            )
        if self.step_factor <= 1:
            raise ConfigError(f"must be greater than 1, got {self.step_factor}", field="step_factor")
        for name in ("step_window", "step_min_samples", "confirm_rounds", "step_confirm_checks"):
            _positive(getattr(self, name), name)
        if self.step_min_samples > self.step_window:
            raise ConfigError(
                f"cannot exceed step_window ({self.step_window}), got {self.step_min_samples}",
                field="step_min_samples",
            )


@_checked
@dataclass(frozen=True, kw_only=True)
class ProbeSettings:
    """Probe rounds the master runs (:mod:`phalanx.master.probing`): every member runs the configured probes
    (the matmul probe, the pairwise all-gather probe), and the master evicts the nodes the results single
    out."""

    enabled: bool = setting(False, doc="Run probe rounds (on demand via POST /v1/probe, and as set below).")
    on_round_complete: bool = setting(
        False, doc="Run a probe round right after every rendezvous round completes."
    )
    interval_s: float = setting(
        0.0, doc="Run a probe round this long after the previous one (0: never periodically).", unit="s"
    )
    timeout_s: float = setting(
        120.0,
        doc="A node that has not reported its probes this long after the round began failed them.",
        unit="s",
    )
    kinds: str = setting(
        ",".join(PROBE_KINDS),
        doc="Probes a round runs, comma-separated: matmul (per node), allgather (between nodes; needs two).",
    )
    stragglers: StragglerSettings = group(StragglerSettings, doc="Thresholds of the probe analysis.")

    def __post_init__(self) -> None:
        if self.interval_s < 0:
            raise ConfigError(f"cannot be negative, got {self.interval_s}", field="interval_s")
        _positive(self.timeout_s, "timeout_s")
        parse_probe_kinds(self.kinds, name="kinds")

    @property
    def kind_names(self) -> tuple[str, ...]:
        """The configured probe kinds, in :data:`PROBE_KINDS` order."""
        return parse_probe_kinds(self.kinds, name="kinds")


DEFAULT_STATUS_PROGRESS_INTERVAL_S = 10.0
"""The step alone changes on every heartbeat while training; one status PATCH per job every 10 s keeps a
thousand jobs at about 100 writes a second to the API server."""


@_checked
@dataclass(frozen=True, kw_only=True)
class MasterSettings:
    """Everything a job's master needs."""

    job_id: str = setting("", doc="Name of the job; agents must present the same id.")
    host: str = setting("127.0.0.1", doc="Address the master's servers bind to.")
    grpc_port: int = setting(0, doc="Port of the gRPC service for agents (0: pick a free one).")
    http_port: int = setting(0, doc="Port of the HTTP API and /metrics (0: pick a free one).")
    token_file: str = setting("", doc="File holding the job's bearer token.")
    metrics_token_file: str = setting(
        "",
        doc="File holding a second token, good for GET /metrics only: one Prometheus credential for every "
        "job's master. Empty, or a missing file: /metrics needs the job's token.",
    )
    tls_cert_file: str = setting(
        "",
        doc="PEM certificate (chain) the master's gRPC and HTTP servers present; with tls_key_file, both "
        "serve TLS only. Empty: plain text.",
    )
    tls_key_file: str = setting("", doc="PEM private key of tls_cert_file.")
    state_path: str = setting("", doc="Where the master keeps its durable state (a file path locally).")
    log_dir: str = setting("", doc="Directory of the append-only job log; empty: beside the state file.")
    long_poll_max_s: float = setting(
        30.0, doc="Longest time the master holds a GetRendezvous call.", unit="s"
    )
    user_error_window_s: float = setting(
        10.0, doc="A user error reported by every node within this window fails the job at once.", unit="s"
    )
    max_request_bytes: int = setting(
        limits.DEFAULT_MAX_REQUEST_BYTES, doc="Largest gRPC request the master accepts.", unit="bytes"
    )
    status_progress_interval_s: float = setting(
        DEFAULT_STATUS_PROGRESS_INTERVAL_S,
        doc="In Kubernetes, how often at most training progress alone (the step) is written into the "
        "ElasticJob status; a phase change, evictions, a new round or a committed checkpoint are written at "
        "once. 0: every change at once.",
        unit="s",
    )
    rendezvous: RendezvousSettings = group(RendezvousSettings, doc="Rendezvous rounds.")
    heartbeat: HeartbeatSettings = group(HeartbeatSettings, doc="Node liveness.")
    restart: RestartSettings = group(RestartSettings, doc="Restart and eviction budgets.")
    logs: LogSettings = group(LogSettings, doc="Log aggregation.")
    probes: ProbeSettings = group(ProbeSettings, doc="Health-probe rounds and straggler eviction.")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?", self.job_id or ""):
            raise ConfigError(
                f"must be 1-63 lower-case letters, digits, '-' or '.', starting and ending alphanumeric; "
                f"got {self.job_id!r}",
                field="job_id",
            )
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"must be a port number between 0 and 65535, got {port}", field=name)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            raise ConfigError("TLS needs both a certificate and its key; give both or neither", field=missing)
        _positive(self.long_poll_max_s, "long_poll_max_s")
        if self.user_error_window_s < 0:
            raise ConfigError(
                f"cannot be negative, got {self.user_error_window_s}", field="user_error_window_s"
            )
        if self.status_progress_interval_s < 0:
            raise ConfigError(
                f"cannot be negative, got {self.status_progress_interval_s}",
                field="status_progress_interval_s",
            )
        if self.max_request_bytes < limits.MIN_MAX_REQUEST_BYTES:
            raise ConfigError(
                f"must be at least {limits.MIN_MAX_REQUEST_BYTES}, got {self.max_request_bytes}",
                field="max_request_bytes",
            )


@_checked
@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """Everything a node agent (`phalanx-run`) reads from its flags and ``PHALANX_*`` variables: a flag wins
    over its variable, a variable over the default here (:mod:`phalanx.agent.config`)."""

    job_id: str = setting("", doc="Name of the job (torchrun's --rdzv-id).")
    node_id: str = setting("", doc="Stable name of this node within the job; empty: the host name.")
    master_addr: str = setting("", doc="host:port of the master's gRPC service (torchrun's --rdzv-endpoint).")
    token_file: str = setting("", doc="File holding the job's bearer token.")
    host: str = setting("", doc="Address the other nodes reach this node at; empty: the host name's address.")
    nproc_per_node: int = setting(1, doc="Training processes this node runs.")
    max_restarts: int = setting(
        0,
        doc="Restarts of this node's workers the agent carries out before it exits (torchrun's meaning); the "
        "job's own budget is the master's.",
    )
    monitor_interval_s: float = setting(0.1, doc="How often the agent checks its workers.", unit="s")
    grace_period_s: float = setting(
        5.0, doc="Time workers get between SIGTERM and SIGKILL when they are stopped.", unit="s"
    )
    log_dir: str = setting("", doc="Directory for per-rank log and error files; empty: a temporary one.")
    warm_spares: bool = setting(True, doc="Start workers from spares that imported torch beforehand.")
    warm_probes: bool = setting(
        True, doc="Fork each health probe from a probe server that imported torch beforehand."
    )
    checkpoint_host: bool = setting(True, doc="Run the node's flash-checkpoint host.")
    hang: HangSettings = group(HangSettings, doc="Hang detection.")
    logs: LogSettings = group(LogSettings, doc="Log shipping limits.")
    checkpoint: CheckpointSettings = group(CheckpointSettings, doc="Flash checkpoint.")

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"must be at least 1, got {self.nproc_per_node}", field="nproc_per_node")
        if self.max_restarts < 0:
            raise ConfigError(f"cannot be negative, got {self.max_restarts}", field="max_restarts")
        _positive(self.monitor_interval_s, "monitor_interval_s")
        if self.grace_period_s < 0:
            raise ConfigError(f"cannot be negative, got {self.grace_period_s}", field="grace_period_s")


@_checked
@dataclass(frozen=True, kw_only=True)
class JobPodSettings:
    """How the operator shapes an ElasticJob's Pods beyond its template: the defaults of
    ``spec.sharedMemory``, ``spec.terminationGracePeriod`` and ``spec.createRefusedTimeout``."""

    shared_memory: bool = setting(
        True,
        doc="Mount a memory-backed emptyDir at /dev/shm in the worker containers (a container runtime's own "
        "/dev/shm is 64Mi, too small for any flash checkpoint).",
    )
    shared_memory_per_process_mib: int = setting(
        2048,
        doc="Size of /dev/shm per training process when sharedMemory.sizeLimit is not given (capped at "
        "the first container's memory limit): each rank keeps two slots of its state (x1.1), so about "
        "0.9Gi of checkpointed state per rank.",
        unit="MiB",
    )
    persist_on_exit_s: float = setting(
        130.0,
        doc="Time a terminated worker Pod gets beyond restart.gracePeriod to persist its newest in-memory "
        "snapshot and exit: the agent waits up to 120s for that write; 10s more let its checkpoint host "
        "stop.",
        unit="s",
    )
    create_refused_timeout_s: float = setting(
        600.0,
        doc="How long the API server may go on refusing to create one of the job's Pods or objects "
        "(Forbidden, Invalid, quota exceeded) before the job fails.",
        unit="s",
    )

    def __post_init__(self) -> None:
        _positive(self.shared_memory_per_process_mib, "shared_memory_per_process_mib")
        _positive(self.persist_on_exit_s, "persist_on_exit_s")
        _positive(self.create_refused_timeout_s, "create_refused_timeout_s")


@_checked
@dataclass(frozen=True, kw_only=True)
class OperatorSettings:
    """The Kubernetes operator (`phalanx operator`)."""

    namespace: str = setting(
        "", doc="Namespace whose ElasticJobs the operator handles; empty: all namespaces."
    )
    image: str = setting(
        "ghcr.io/phalanx-dev/phalanx:0.1.0",
        doc="Container image of the master Pod (built from the Dockerfile).",
    )
    command_prefix: str = setting(
        "",
        doc="Prepended to the phalanx and phalanx-run commands in Pods (a bin directory ending in '/'); "
        "empty: the image's PATH.",
    )
    master_grpc_port: int = setting(29400, doc="Port of the master's gRPC service for agents.")
    master_http_port: int = setting(8080, doc="Port of the master's HTTP API and /metrics.")
    metrics_token_file: str = setting(
        "",
        doc="File holding the token Prometheus presents to every job's master, good for /metrics only; "
        "the operator copies it into each job's token Secret. Empty: /metrics needs each job's own token.",
    )
    reconcile_interval_s: float = setting(
        2.0, doc="How often each job is reconciled against its Pods, whatever the events.", unit="s"
    )
    http_port: int = setting(
        8081,
        doc="Port of the operator's own /healthz (liveness: its event loop answers and, on the leader, its "
        "periodic passes run) and /metrics (needs the metrics token; served only with one); 0: none.",
    )
    finish_grace_s: float = setting(
        10.0,
        doc="How long Pods still running when a job finished get to exit by themselves before cleanup.",
        unit="s",
    )
    # Trust switches: what the operator may do beyond a job's own namespace, set by the cluster's
    # administrator (Helm values), never by a job. A job author controls the evidence (a training script can
    # hang its own node, and it can read the job token), so nothing a job says reaches objects it does not
    # own unless the administrator chose to trust jobs that far. All off by default.
    cordon_nodes: bool = setting(
        False,
        doc="Allow jobs with spec.cordonBadNodes to cordon and taint the Kubernetes node of a worker Pod the "
        "operator evicted (its spec.nodeName, never a name the job reports). Off: no job cordons anything, "
        "and the operator needs no permission on nodes.",
    )
    network_policy: bool = setting(
        False,
        doc="Give every job a NetworkPolicy <job>-master: only the job's own Pods and the monitoring "
        "namespace reach its master's ports. Needs a network plugin that enforces NetworkPolicies.",
    )
    tls_ca_secret: str = setting(
        "",
        doc="Serve every job's master over TLS: the Secret (in the operator's namespace; tls.crt, tls.key) "
        "of the CA that signs each job's master certificate, made by the operator when it does not exist. "
        "Workers get the CA certificate only. Empty: masters speak plain text.",
    )
    monitoring_namespace: str = setting(
        "monitoring",
        doc="Namespace (its kubernetes.io/metadata.name label) whose Pods may scrape every master's /metrics "
        "through the per-job NetworkPolicy; empty: none.",
    )

    def __post_init__(self) -> None:
        _positive(self.reconcile_interval_s, "reconcile_interval_s")
        if self.finish_grace_s < 0:
            raise ConfigError(f"cannot be negative, got {self.finish_grace_s}", field="finish_grace_s")
        for name in ("master_grpc_port", "master_http_port"):
            port = getattr(self, name)
            if not 0 < port <= 65535:
                raise ConfigError(f"must be a port number between 1 and 65535, got {port}", field=name)
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"must be a port number or 0 (none), got {self.http_port}", field="http_port")
