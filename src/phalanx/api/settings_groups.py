"""The settings groups of a job that the master, the agent and the operator share: rendezvous, liveness, hang
detection, restart budgets, log shipping, flash checkpoints, stragglers and probe rounds.

Each group is a frozen dataclass declared from the field table (:mod:`phalanx.api.settings_table`); its
``__post_init__`` validates it and raises :class:`~phalanx.api.errors.ConfigError` naming the field. The
settings of each process, which nest these groups, are in :mod:`phalanx.api.settings`.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.api.errors import ConfigError
from phalanx.api.settings_table import checked, group, positive, setting

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


@checked
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
        positive(self.min_nodes_timeout_s, "min_nodes_timeout_s")


@checked
@dataclass(frozen=True, kw_only=True)
class HeartbeatSettings:
    """Liveness of nodes."""

    interval_s: float = setting(1.0, doc="How often an agent sends a heartbeat.", unit="s")
    timeout_s: float = setting(10.0, doc="Silence after which the master declares a node lost.", unit="s")

    def __post_init__(self) -> None:
        positive(self.interval_s, "interval_s")
        if self.timeout_s < 2.0:
            raise ConfigError(f"must be at least 2s, got {self.timeout_s}s", field="timeout_s")
        if self.timeout_s < 2 * self.interval_s:
            raise ConfigError(
                f"must be at least twice interval_s ({self.interval_s}s), got {self.timeout_s}s",
                field="timeout_s",
            )


@checked
@dataclass(frozen=True, kw_only=True)
class HangSettings:
    """Hang detection from progress beacons and interval recorders: a rank is hung when it shows no progress
    (its beacon, or its recorder's newest record or oldest pending device work) for longer than
    ``max(floor_s, factor * p99 of its recent step intervals)`` while it waits in a recorded collective or on
    the GPU, and ``max(idle_floor_s, factor * p99)`` anywhere else (between collectives, or without the
    recorder), where a healthy rank may be saving a checkpoint or evaluating."""

    enabled: bool = setting(True, doc="Detect hung workers from stale progress beacons.")
    instrument: bool = setting(
        True,
        doc="Record the workers' steps (from the optimizer) and collectives (from torch's flight recorder "
        "and c10d's hooks) without the script's help, for hang detection and progress (phalanx.instrument).",
    )
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
    stopped_s: float = setting(
        2.0,
        doc="How long a worker's process may stay stopped by a signal (SIGSTOP or SIGTSTP: state T in "
        "/proc) before it counts as hung: it cannot run until someone resumes it, whatever its steps.",
        unit="s",
    )
    factor: float = setting(3.0, doc="Multiple of the p99 step interval after which a beacon is stale.")
    startup_s: float = setting(
        600.0,
        doc="How long a worker may run before its first reported step without counting as hung.",
        unit="s",
    )

    def __post_init__(self) -> None:
        positive(self.floor_s, "floor_s")
        positive(self.idle_floor_s, "idle_floor_s")
        positive(self.stopped_s, "stopped_s")
        if self.factor < 1:
            raise ConfigError(f"must be at least 1, got {self.factor}", field="factor")
        positive(self.startup_s, "startup_s")


@checked
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


@checked
@dataclass(frozen=True, kw_only=True)
class LogSettings:
    """Worker log shipping and the master's log buffers."""

    max_line_bytes: int = setting(4096, doc="Longer worker output lines are truncated to this.", unit="bytes")
    max_lines_per_s: int = setting(2000, doc="Lines per second a node may ship; excess lines are counted.")
    ring_lines: int = setting(2000, doc="Lines the master keeps per node and rank.")

    def __post_init__(self) -> None:
        for name in ("max_line_bytes", "max_lines_per_s", "ring_lines"):
            positive(getattr(self, name), name)


@checked
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
        positive(self.memory_interval_steps, "memory_interval_steps")
        if self.persist_interval_steps < 0:
            raise ConfigError(
                f"cannot be negative, got {self.persist_interval_steps}", field="persist_interval_steps"
            )
        positive(self.keep_last, "keep_last")


@checked
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
            positive(getattr(self, name), name)
        if self.step_min_samples > self.step_window:
            raise ConfigError(
                f"cannot exceed step_window ({self.step_window}), got {self.step_min_samples}",
                field="step_min_samples",
            )


@checked
@dataclass(frozen=True, kw_only=True)
class ProbeSettings:
    """Probe rounds the master runs (:mod:`phalanx.master.job.probes`): every member runs the configured
    probes (the matmul probe, the pairwise all-gather probe), and the master evicts the nodes the results
    single out."""

    enabled: bool = setting(False, doc="Run probe rounds (on demand via POST /v1/probe, and as set below).")
    on_round_complete: bool = setting(
        False, doc="Run a probe round right after every rendezvous round completes."
    )
    interval_s: float = setting(
        0.0,
        doc="Run a probe round this long after the previous one, or after the rendezvous round's first "
        "training step where that came later (2 minutes after it formed, if it reports none; 0: never "
        "periodically).",
        unit="s",
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
        positive(self.timeout_s, "timeout_s")
        parse_probe_kinds(self.kinds, name="kinds")

    @property
    def kind_names(self) -> tuple[str, ...]:
        """The configured probe kinds, in :data:`PROBE_KINDS` order."""
        return parse_probe_kinds(self.kinds, name="kinds")
