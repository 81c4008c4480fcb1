"""The root cause of a round's failures, not its echo.

When one rank dies, its peers fail next: gloo's "Connection closed by peer", NCCL's "remote process exited",
a store timeout, a watchdog abort. Those errors are echoes of the first failure, and they can carry the
earlier timestamp: a peer's error time comes from its error file, while a SIGKILLed rank writes none and is
only dated when its agent notices the exit. So the root cause is chosen by kind first and time second:

1. a real cause: a signal death, an out-of-memory kill, a hardware error, a hang verdict, a user exception;
2. an exit nothing explains (no traceback, no marker);
3. a communication echo (:data:`phalanx.diagnostics.classify.ECHO`, or the ``comm`` class).

Among equals, the earliest (then the lowest rank). :func:`explain` says why in one sentence. Pure and
torch-free: the agent orders what it reports with it, the master picks the round's root cause with it.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from typing import Protocol, TypeVar

from phalanx.api.failures import FailureClass
from phalanx.diagnostics.classify import ECHO

__all__ = ["SETTLE_S", "FailureLike", "explain", "is_echo", "pick", "settled", "sort_key", "tier"]

REAL_CAUSES = frozenset({"killed", "oom", "hardware", "hang", "user"})
"""Failure classes (lower-case :class:`~phalanx.diagnostics.classify.FailureClass` names) that are causes."""

SETTLE_S = 2.0
"""How long after a restart its event waits for the round's other failure reports (see :func:`settled`).
The echo's node often reports first: its rank's gloo error surfaces within milliseconds, while the agent of
a SIGKILLed rank sees the exit in its next 0.1 s tick; on a loaded machine a report may take a second."""

MAX_MESSAGE_CHARS = 160
"""How much of the root cause's message the sentence quotes (its first line)."""
_HUNG_PREFIX = re.compile(r"^rank -?\d+ hung:\s*")


class FailureLike(Protocol):
    """What the decision needs of a failure; the master's ``FailureRecord`` has exactly these."""

    @property
    def node_id(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def exit_code(self) -> int: ...
    @property
    def failure_class(self) -> FailureClass | str:
        """The class, or its label (:attr:`FailureClass.label`)."""
        ...

    @property
    def message(self) -> str: ...
    @property
    def unix(self) -> float:
        """When it failed: the worker's own error time when known, else when its agent saw it exit."""
        ...


F = TypeVar("F", bound=FailureLike)


def _label(failure_class: FailureClass | str) -> str:
    return failure_class.label if isinstance(failure_class, FailureClass) else failure_class


def is_echo(failure_class: FailureClass | str, message: str) -> bool:
    """Whether a failure is the echo of another's: the ``comm`` class, or a user exception, an unexplained
    exit or a hang verdict whose message is a peer-lost error (an older agent's class; a rank its agent found
    hung that had raised on its peer's loss by the time the report was written: its error file's time, whole
    seconds in torch's format, would otherwise put it before the peer that hung first)."""
    failure_class = _label(failure_class)
    if failure_class == "comm":
        return True
    return failure_class not in REAL_CAUSES - {"user", "hang"} and bool(ECHO.search(message))


def tier(failure_class: FailureClass | str, message: str) -> int:
    """0: a real cause, 1: an unexplained exit, 2: a communication echo (lower ranks first)."""
    failure_class = _label(failure_class)
    if is_echo(failure_class, message):
        return 2
    return 0 if failure_class in REAL_CAUSES else 1


def sort_key(f: FailureLike) -> tuple[int, float, int]:
    return (tier(f.failure_class, f.message), f.unix or float("inf"), f.rank)


def pick(failures: Sequence[F]) -> F | None:
    """The root cause among ``failures`` (see the module docstring); None for none."""
    return min(failures, key=sort_key, default=None)


def _signal_name(exit_code: int) -> str:
    number = -exit_code if exit_code < 0 else exit_code - 128 if exit_code > 128 else 0
    try:
        return signal.Signals(number).name if number else ""
    except ValueError:
        return f"signal {number}"


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= MAX_MESSAGE_CHARS else line[: MAX_MESSAGE_CHARS - 3] + "..."


def _what(f: FailureLike) -> str:
    """What happened to the root cause, as a verb phrase."""
    message = _first_line(f.message)
    cls = _label(f.failure_class)
    if cls == "killed":
        name = _signal_name(f.exit_code)
        what = "SIGKILLed" if name == "SIGKILL" else f"killed by {name}" if name else "was killed"
        return f"{what}: {message}" if message else what
    if cls == "oom":
        return f"ran out of memory: {message}" if message else "ran out of memory"
    if cls == "hardware":
        return f"hit a hardware error: {message}" if message else "hit a hardware error"
    if cls == "hang":
        message = _HUNG_PREFIX.sub("", message)  # the agent's verdict names the rank already
        return f"hung: {message}" if message else "hung"
    if cls == "user":
        return f"raised {message}" if message else f"exited with code {f.exit_code}"
    if is_echo(cls, f.message):
        return f"lost its peers first: {message}" if message else "lost its peers first"
    return f"exited with code {f.exit_code}" + (f": {message}" if message else "")


def _clock(unix: float) -> str:
    """12:00:01.2 (UTC): enough to line a sentence up with logs, short enough for an event."""
    if unix <= 0:
        return ""
    t = datetime.fromtimestamp(unix, UTC)
    return f" at {t:%H:%M:%S}.{t.microsecond // 100_000} UTC"


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def explain(root: FailureLike, failures: Sequence[FailureLike]) -> str:
    """One sentence: the root cause, when, and what the other failures were to it, e.g. ``rank 1 on node-1
    SIGKILLed at 12:00:01.2 UTC; ranks 0, 2, 3 lost their peer after it``."""
    who = f"rank {root.rank} on {root.node_id}" if root.rank >= 0 else root.node_id
    if root.rank < 0 and root.message:
        sentence = f"{who}: {_first_line(root.message)}{_clock(root.unix)}"
    else:
        sentence = f"{who} {_what(root)}{_clock(root.unix)}"
    others = [f for f in failures if f is not root and (f.rank, f.node_id) != (root.rank, root.node_id)]
    echoes = sorted({f.rank for f in others if is_echo(f.failure_class, f.message) and f.rank >= 0})
    also = sorted({f.rank for f in others if not is_echo(f.failure_class, f.message) and f.rank >= 0})
    if echoes and tier(root.failure_class, root.message) < 2:
        verb = "lost its peer" if len(echoes) == 1 else "lost their peer"
        sentence += f"; {_ranks(echoes)} {verb} after it"
    elif echoes:
        sentence += f"; {_ranks(echoes)} too"
    if also:
        sentence += f"; {_ranks(also)} also failed"
    return sentence


def settled(
    *, waited_s: float, reported: Collection[str], members: Collection[str], window_s: float = SETTLE_S
) -> bool:
    """Whether the root cause of a round's failures can be named for good, ``waited_s`` after the first
    report: every member of the round has reported (nothing better can come), or ``window_s`` has passed (a
    member that says nothing by then either failed in a way its report will not fix, or its report is
    revised later by a ``root_cause`` event). The restart itself never waits for this: only its event."""
    return waited_s >= window_s or (bool(members) and set(members) <= set(reported))
