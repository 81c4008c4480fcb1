"""Failure policy: what the master does when a node reports failed workers.

:func:`decide_failure` is a pure function of the job's situation, the report and ``now``; the job
(:mod:`phalanx.master.job`) carries the decision out. In order of precedence:

1. **User error, fail fast.** A ``FAILURE_CLASS_USER`` failure with the same error message on every rank
   of the round, or reported by every node of a multi-node round within ``user_error_window_s``, fails the job
   with that message: restarting cannot fix a bug, and burning the restart budget only delays the news.
2. **Hardware.** A ``FAILURE_CLASS_HARDWARE`` failure evicts the node (it is replaced) while evictions
   are left, else the job fails.
3. **Hang.** A hang restarts the round in place and asks every member for its stacks. It counts against
   the node the evidence singles out (``hang.blame``: a stopped rank, the recorder's suspects, odd stacks),
   never merely the node that reported it; a node charged a second time is evicted. With no such evidence
   at report time, the stack analysis may charge a node later.
4. **Anything else** restarts the round in place (a new round with the same membership) while restarts
   are left, else the job fails.

A report for a round that is already restarting only adds evidence: it can still turn the restart into
a fail-fast user error or evict a node with broken hardware, but it never spends a second restart.

The *root cause* of a round is its first real failure (:mod:`phalanx.diagnostics.rootcause`): a signal
death, an OOM kill, a hardware error, a hang or a user exception outranks a peer's communication error (its
echo), and among equals the earliest wins, by the worker's own error time when its error file had one,
else when the agent observed the exit. Reasons name it in one sentence (``rootcause.explain``). A
failure's message is the error file's, else the last ``SomeError: ...`` line of the worker's log tail
(plain scripts write no error file).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from phalanx.api import limits
from phalanx.api.failures import FailureClass
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import rootcause

__all__ = [
    "Decision",
    "FailureRecord",
    "PolicyInput",
    "Verdict",
    "decide_failure",
    "explain_cause",
    "records_from_request",
    "root_cause",
    "user_error",
]


FailureKind = Literal["worker_exit", "hang", "launch"]
"""What an agent reported: a worker exited, a worker hung, or workers could not be started."""


@dataclass(frozen=True, kw_only=True)
class FailureRecord:
    """One failed worker as the master keeps it (JSON-friendly)."""

    node_id: str
    round: int
    rank: int
    local_rank: int = 0
    exit_code: int = 1
    failure_class: FailureClass = FailureClass.UNKNOWN
    """JSON and sentences print its label: user, killed, oom, comm, hardware, hang, unknown."""
    kind: FailureKind = "worker_exit"
    message: str = ""
    traceback: str = ""
    log_tail: tuple[str, ...] = ()
    unix: float = 0.0
    """When the failure happened: the worker's error time if known, else when the agent saw it."""
    last_step: int = -1

    @property
    def hung(self) -> bool:
        """A hang: reported as one (its class may still say more, such as comm), or classified as one."""
        return self.kind == "hang" or self.failure_class is FailureClass.HANG

    def summary(self) -> str:
        what = self.message or f"exit code {self.exit_code}"
        return f"rank {self.rank} on {self.node_id} ({self.failure_class.label}): {what}"

    def to_json(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "round": self.round,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "exit_code": self.exit_code,
            "failure_class": self.failure_class.label,
            "kind": self.kind,
            "message": self.message,
            "traceback": self.traceback,
            "log_tail": list(self.log_tail),
            "unix": self.unix,
            "last_step": self.last_step,
        }


# Failure records end up in the durable state (root cause): bound what an agent can make the master keep.
MAX_MESSAGE_CHARS = limits.MAX_MESSAGE_CHARS
MAX_TRACEBACK_CHARS = limits.MAX_TRACEBACK_CHARS
MAX_TAIL_LINES = limits.MAX_TAIL_LINES

# The last line of a Python traceback: "ValueError: bad shape", "torch.OutOfMemoryError: ...", "KeyError".
_EXCEPTION_LINE = re.compile(
    r"^(?:\[[^\]]*\]:?\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)(?::.*)?)$"
)


def exception_line(log_tail: Sequence[str]) -> str:
    """The last ``SomeError: message`` line of a worker's output, or "" (for workers without error file)."""
    for line in reversed(log_tail):
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return match.group(1).strip()
    return ""


def failure_kind(value: int) -> FailureKind:
    """A report's kind; unspecified (an older agent) is a worker exit, one this master does not know too."""
    if value == pb.FAILURE_KIND_HANG:
        return "hang"
    if value == pb.FAILURE_KIND_LAUNCH:
        return "launch"
    return "worker_exit"


def records_from_request(request: pb.ReportFailureRequest, *, now: float) -> list[FailureRecord]:
    """Normalizes a ReportFailure request; a report without worker entries becomes one synthetic record."""
    kind = failure_kind(request.kind)
    records = []
    for f in request.failures:
        stamp_ns = f.error_unix_ns or f.observed_unix_ns
        cls = FailureClass.of(f.failure_class)
        records.append(
            FailureRecord(
                node_id=request.node_id,
                round=request.round,
                rank=f.rank,
                local_rank=f.local_rank,
                exit_code=f.exit_code,
                failure_class=FailureClass.HANG
                if kind == "hang" and cls is FailureClass.UNSPECIFIED
                else cls,
                kind=kind,
                message=(f.error_message or exception_line(f.log_tail))[:MAX_MESSAGE_CHARS],
                traceback=f.error_traceback[-MAX_TRACEBACK_CHARS:],
                log_tail=tuple(line[:MAX_MESSAGE_CHARS] for line in f.log_tail[-MAX_TAIL_LINES:]),
                unix=stamp_ns / 1e9 if stamp_ns else now,
                last_step=f.last_step,
            )
        )
    if not records:
        records.append(
            FailureRecord(
                node_id=request.node_id,
                round=request.round,
                rank=-1,
                failure_class=FailureClass.HANG if kind == "hang" else FailureClass.UNKNOWN,
                kind=kind,
                message=f"{kind.replace('_', ' ')} reported without worker details",
                unix=now,
            )
        )
    return records


def root_cause(records: Sequence[FailureRecord]) -> FailureRecord | None:
    """The first real failure, echoes last (see :mod:`phalanx.diagnostics.rootcause`)."""
    return rootcause.pick(records)


def explain_cause(records: Sequence[FailureRecord]) -> str:
    """The root cause of ``records`` and what the others were to it, in one sentence ("" for none)."""
    root = root_cause(records)
    return rootcause.explain(root, records) if root else ""


def user_error(
    records: Sequence[FailureRecord], *, members: Sequence[str], world_size: int, window_s: float
) -> str | None:
    """The error message when the round's failures are a user error every rank or node agrees on."""
    user = [r for r in records if r.failure_class is FailureClass.USER and r.message]
    if not user:
        return None
    # Every rank of the round raised the same exception.
    by_rank = {r.rank: r.message for r in user}
    # Counted first: at 32,768 ranks, a set of every rank per report costs more than the rest of the decision.
    every_rank = len(by_rank) >= world_size and all(rank in by_rank for rank in range(world_size))
    if world_size > 0 and every_rank and len(set(by_rank.values())) == 1:
        return user[0].message
    # Every node reported the same user error within the window (its other ranks were stopped by the agent).
    # Needs two nodes at least: on one node, one failing rank of several is no evidence of a bug everywhere.
    if len(members) < 2:
        return None
    first_by_node: dict[str, FailureRecord] = {}
    for r in sorted(user, key=lambda r: r.unix):
        first_by_node.setdefault(r.node_id, r)
    if members and set(first_by_node) >= set(members):
        chosen = [first_by_node[n] for n in members]
        if len({r.message for r in chosen}) == 1:
            times = [r.unix for r in chosen]
            if max(times) - min(times) <= window_s:
                return chosen[0].message
    return None


class Verdict(enum.Enum):
    """What the job does about a failure."""

    NONE = "none"
    """Nothing more: the round is already restarting."""
    RESTART = "restart"
    """Restart in place: a new round with the same membership."""
    EVICT = "evict"
    """Evict the node (it is replaced) and restart without it."""
    FAIL = "fail"
    """The job fails."""


@dataclass(frozen=True, kw_only=True)
class PolicyInput:
    """The job's situation when a failure report arrives."""

    node_id: str
    report: Sequence[FailureRecord]
    """The failures of this report."""
    round_records: Sequence[FailureRecord]
    """Every failure of the round so far, this report included."""
    members: Sequence[str]
    world_size: int
    restart_count: int
    max_restarts: int
    eviction_count: int
    max_evictions: int
    hang_suspect: str = ""
    """For a hang: the node the evidence at hand singles out (``hang.blame``); "": none, the hang counts
    against no node (the reporter may be the victim)."""
    hang_blame_why: str = ""
    """The evidence behind ``hang_suspect`` (or why there is none), for the reason."""
    suspect_hang_count: int = 0
    """Hangs counted against ``hang_suspect`` before this report."""
    already_restarting: bool = False
    user_error_window_s: float = 10.0


@dataclass(frozen=True, kw_only=True)
class Decision:
    verdict: Verdict
    reason: str
    root: FailureRecord | None = None
    evict_kind: str = ""
    """Bounded label of the eviction reason: hardware or hang."""
    dump_stacks: bool = False
    blamed: str = ""
    """For a hang: the node it counts against (evicted on its second hang); "": none."""


def decide_failure(inp: PolicyInput, *, now: float) -> Decision:
    """Decides what to do about a failure report (see the module docstring)."""
    round_root = root_cause(inp.round_records)  # once: a scan of every failure of the round
    root = round_root or root_cause(inp.report)
    known = inp.round_records if round_root else inp.report
    cause = rootcause.explain(root, known) if root else f"failure on {inp.node_id}"
    message = user_error(
        inp.round_records, members=inp.members, world_size=inp.world_size, window_s=inp.user_error_window_s
    )
    if message is not None:
        return Decision(verdict=Verdict.FAIL, root=root, reason=f"user error on every rank: {message}")

    def evict(kind: str, why: str) -> Decision:
        if inp.eviction_count >= inp.max_evictions:
            return Decision(
                verdict=Verdict.FAIL,
                root=root,
                reason=f"{why}, and the eviction budget ({inp.max_evictions}) is spent; root cause: {cause}",
            )
        return Decision(verdict=Verdict.EVICT, root=root, reason=why, evict_kind=kind)

    if any(r.failure_class is FailureClass.HARDWARE for r in inp.report):
        return evict("hardware", f"hardware failure on {inp.node_id}: {_first_message(inp.report)}")
    if inp.already_restarting:
        return Decision(
            verdict=Verdict.NONE, root=root, reason=f"round already restarting; root cause: {cause}"
        )
    hang = any(r.hung for r in inp.report)
    blamed = inp.hang_suspect if hang else ""
    hangs = inp.suspect_hang_count
    if blamed and hangs + 1 >= 2:
        why = f" ({inp.hang_blame_why})" if inp.hang_blame_why else ""
        decision = evict("hang", f"{blamed} hung {hangs + 1} times{why}")
        return Decision(
            verdict=decision.verdict,
            root=root,
            reason=decision.reason,
            evict_kind=decision.evict_kind,
            blamed=blamed,
        )
    if inp.restart_count >= inp.max_restarts:
        return Decision(
            verdict=Verdict.FAIL,
            root=root,
            reason=f"restart budget ({inp.max_restarts}) spent; root cause: {cause}",
        )
    why = f"worker failure: {cause}"
    if hang and blamed:
        why = f"hang on {inp.node_id}" + (f", blamed on {blamed}" if blamed != inp.node_id else "")
        why += f": {inp.hang_blame_why}" if inp.hang_blame_why else ""
    elif hang:
        why = f"hang on {inp.node_id}, counted against no node for now: {inp.hang_blame_why or 'no evidence'}"
    return Decision(verdict=Verdict.RESTART, root=root, reason=why, dump_stacks=hang, blamed=blamed)


def _first_message(records: Sequence[FailureRecord]) -> str:
    return next(
        (r.message for r in records if r.message), f"exit code {records[0].exit_code}" if records else ""
    )
