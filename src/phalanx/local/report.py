"""The run summary of ``phalanx local``: the ``--summary-json`` document and the table a person reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.local.foldin import FoldIn


@dataclass
class FailureRecord:
    """One injected fault and what became of it; times are seconds since the job started."""

    kind: str
    node: str
    rank: int
    injected_at: float
    step_at_injection: int = -1
    """The step every live rank had completed when the fault hit (the slowest rank's): a synchronous job's
    step is done when its last rank is, and ranks one step ahead hold work the job never completed."""
    detected_at: float | None = None
    recovered_at: float | None = None
    healed_at: float | None = None
    """When a lasting fault (``for=``) was healed."""
    action: str = ""
    steps_lost: int | None = None
    resumed_step: int | None = None
    round_at_injection: int = 0
    recovery_round_seen_ns: int = 0
    host_pid: int = 0
    """A checkpoint-host fault: the pid of the host it hit."""
    recovery: str = ""
    """How the job recovered (:func:`recovery_action`); ``action`` says what was done to the node."""
    survivors: dict[str, int] = field(default_factory=dict)
    """"node/local rank" -> pid of the workers the fault did not hit, as their beacons said when it hit:
    whether they still run at recovery tells an in-process regroup from a restart."""
    fold_in: FoldIn | None = None
    """The node's replacement, folded into the job later: part of this fault (:mod:`.foldin`)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in (
            "step_at_injection",
            "resumed_step",
            "round_at_injection",
            "recovery_round_seen_ns",
            "host_pid",
            "survivors",
            "fold_in",
        ):
            data.pop(key)
        data["action"] = self.described()
        if self.fold_in is not None:
            data["fold_in"] = self.fold_in.to_json()
        return data

    def described(self) -> str:
        fold = self.fold_in.described(injected_at=self.injected_at) if self.fold_in is not None else ""
        return "; ".join(part for part in (self.recovery, self.action, fold) if part)


HEAL_GRACE_S = 1.0
"""How long after its heal a lasting fault may still be what the job noticed (the news of a cut link can
arrive as it heals)."""


def cause_of(failures: list[FailureRecord], *, node: str, at: float) -> FailureRecord | None:
    """The injected fault that an event of the job about ``node`` at ``at`` is put down to: the latest one
    on that node not yet detected that may still be felt. A fault healed before the event is not its cause,
    nor is a master kill (detected when the master answers again)."""
    for f in reversed(failures):
        if f.detected_at is not None or f.kind == "kill-master" or (node and node != f.node):
            continue
        if f.healed_at is not None and at > f.healed_at + HEAL_GRACE_S:
            continue
        return f
    return None


def recovery_action(*, survivors: dict[str, int], running: dict[str, int], world: int, round_: int) -> str:
    """What the job did about a fault, from the workers' own beacons: if every worker the fault spared still
    runs in the same process, the job re-formed its groups in process; otherwise its workers restarted.
    ``survivors`` and ``running`` map "node/local rank" to the pid, at the fault and at recovery."""
    if survivors and all(running.get(key) == pid for key, pid in survivors.items()):
        return f"re-formed in process at world {world} (round {round_})"
    return f"workers restarted (round {round_})"


@dataclass
class Summary:
    job_id: str
    exit: str = "failed"
    reason: str = ""
    steps_completed: int = 0
    wall_seconds: float = 0.0
    rounds: int = 0
    failures: list[FailureRecord] = field(default_factory=list)
    evictions: list[dict[str, Any]] = field(default_factory=list)
    started_unix: float = 0.0
    """When the run began (the "at" times are seconds after it)."""
    not_injected: list[str] = field(default_factory=list)
    """The ``--inject`` specs that never fired (the run ended first, or their target never came to be): an
    error of the run, never a silent omission."""

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "exit": self.exit,
            "reason": self.reason,
            "steps_completed": self.steps_completed,
            "wall_seconds": round(self.wall_seconds, 3),
            "started_unix": round(self.started_unix, 3),
            "rounds": self.rounds,
            "failures": [f.to_json() for f in self.failures],
            "evictions": self.evictions,
            "not_injected": self.not_injected,
        }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def table(summary: Summary) -> str:
    """A fixed-width table of the failures: detection latency, recovery time and steps lost."""
    lines = [
        f"job {summary.job_id}: {summary.exit.upper()} after {summary.wall_seconds:.1f}s, "
        f"{summary.steps_completed} steps, {summary.rounds} rounds"
        + (f" - {summary.reason}" if summary.reason else ""),
    ]
    lines += [f"NOT INJECTED: {spec}" for spec in summary.not_injected]
    if not summary.failures:
        lines.append("no faults injected")
        return "\n".join(lines)
    cols = ("fault", "node", "rank", "at", "detected", "recovered", "lost")
    header = "{:<14} {:<8} {:>4} {:>8} {:>9} {:>10} {:>5}  action".format(*cols)
    lines += [header, "-" * len(header)]
    for f in summary.failures:
        detect = None if f.detected_at is None else f.detected_at - f.injected_at
        recover = None if f.recovered_at is None else f.recovered_at - f.injected_at
        lost = "-" if f.steps_lost is None else str(f.steps_lost)
        lines.append(
            f"{f.kind:<14} {f.node:<8} {f.rank:>4} {f.injected_at:>7.2f}s {_s(detect):>9} {_s(recover):>10} "
            f"{lost:>5}  {f.described()}"
        )
    lines.append(
        "detected/recovered: seconds after the fault; recovered = first completed step after recovery"
    )
    return "\n".join(lines)
