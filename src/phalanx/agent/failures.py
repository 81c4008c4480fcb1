"""What the agent tells the master about failed or hung workers: each failed rank's exit code, error
file, log tail and failure class (the entries of a ReportFailure request), and the stacks of hung ranks
(ReportStacks).

Both are cut to the master's limits before they are sent (:mod:`phalanx.api.limits`): a worker's
exception message or a stack dump can be megabytes, and a request above the master's ``max_request_bytes``
is refused whole, so the root cause would never arrive. A refused report is sent again cut shorter
(:func:`send_fitted`), down to each rank's exit code and the first lines of its message.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from google.protobuf.message import Message

from phalanx.agent import errorfile, workers
from phalanx.agent.client import RequestTooLargeError
from phalanx.api import limits
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang, rootcause
from phalanx.diagnostics.classify import FailureClass, classify


def _drain(w: workers.Worker) -> None:
    for t in w._threads:  # let the pumps drain what the worker wrote before dying
        t.join(0.5)


def classify_local(w: workers.Worker) -> FailureClass:
    """The failure class of one exited worker, from its exit code, log tail and error file."""
    _drain(w)
    report = errorfile.read(w.paths.error_file) if w.paths else None
    code = w.proc.returncode if w.proc.returncode is not None else 0
    return classify(
        exit_code=code, log_tail=list(w.tail)[-20:], error_message=report.message if report else ""
    )


STOP_MARK = "stop.mark"


def mark_stop(running: Mapping[int, workers.Worker]) -> dict[int, int]:
    """Writes a mark beside each running worker's error file just before the agent stops them; returns each
    mark's modification time: the stop, as the filesystem's clock saw it. File times come from the kernel's
    coarse clock, up to a tick behind ``time.time_ns()``, so an error file a SIGTERM handler wrote just after
    the stop could look older than a stamp the agent took before it (one CI run saw exactly that); against a
    file time from the same clock it cannot."""
    marks = {}
    for lr, w in running.items():
        if w.paths is None:
            continue
        mark = w.paths.error_file.with_name(STOP_MARK)
        try:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.write_bytes(b"")
            marks[lr] = mark.stat().st_mtime_ns
        except OSError:  # no mark: that worker's error file cannot be dated, and counts as the stop's
            continue
    return marks


def raised_before(
    running: Mapping[int, workers.Worker], marks: Mapping[int, int]
) -> dict[int, workers.Worker]:
    """The workers that wrote their error file before the stop marked by :func:`mark_stop`: they had raised
    on their own and were still tearing down, which can take seconds on a loaded machine or in an NCCL
    abort. A file written later, or in the same clock tick, is taken for the stop's own doing (a SIGTERM
    handler that raised): a rank then reports the stop, as it did before this check existed."""
    raised = {}
    for lr, w in running.items():
        try:
            written_ns = w.paths.error_file.stat().st_mtime_ns if w.paths else None
        except OSError:
            written_ns = None
        if written_ns is not None and lr in marks and written_ns < marks[lr]:
            raised[lr] = w
    return raised


def worker_failure(
    local_rank: int,
    w: workers.Worker,
    *,
    hung: bool,
    reason: str,
    history: hang.RankHistory | None,
    stopped_after_raising: bool = False,
    evidence: pb.HangEvidence | None = None,
    observed_unix_ns: int = 0,
) -> pb.WorkerFailure:
    """What one failed or hung worker reports: exit code, error file, log tail and failure class;
    ``observed_unix_ns`` is when the agent saw it exit (0: now)."""
    if not hung:
        _drain(w)
    report = errorfile.read(w.paths.error_file) if w.paths else None
    tail = list(w.tail)[-20:]
    code = w.proc.returncode if w.proc.returncode is not None else 0
    if hung:
        cls = FailureClass.HANG
    else:
        # The exception is the cause, not the signal the agent stopped the worker's teardown with.
        cause_code = 1 if stopped_after_raising else code
        cls = classify(exit_code=cause_code, log_tail=tail, error_message=report.message if report else "")
    return pb.WorkerFailure(
        rank=w.rank,
        local_rank=local_rank,
        exit_code=code,
        failure_class=int(cls),  # type: ignore[arg-type]
        observed_unix_ns=observed_unix_ns or time.time_ns(),
        error_message=(report.message if report else "") or (reason if hung else ""),
        error_traceback=report.traceback if report else "",
        error_unix_ns=report.unix_ns if report else 0,
        log_tail=tail,
        last_step=history.last_step if history else -1,
        hang=evidence if hung else None,  # the verdict's side, age, timeout and the rank's activity
    )


def rank_stacks(
    running: Mapping[int, workers.Worker], histories: Mapping[int, hang.RankHistory], *, now: float
) -> list[pb.RankStacks]:
    """Dumps the stacks of the ``running`` workers (SIGUSR1), with each rank's last step, beacon age and
    process state (a stopped rank is the one a hang is blamed on, see :func:`hang.blame`)."""
    stacks = workers.dump_stacks(list(running.values()))
    entries = []
    for lr, w in running.items():
        h = histories.get(lr)
        entries.append(
            pb.RankStacks(
                rank=w.rank,
                local_rank=lr,
                stacks=stacks.get(lr, "<no stack dump: the process did not answer SIGUSR1>"),
                last_step=h.last_step if h else -1,
                beacon_age_s=now - (h.last_change_at or h.started_at) if h else 0.0,
                # The state the stacks were taken in (a stopped process is sent no SIGUSR1: it cannot answer).
                process_state=workers.process_state(w.pid) if w.proc.poll() is None else "",
            )
        )
    return entries


# ---------------------------------------------------------------------------------------------------
# Cutting reports to the master's limits

log = logging.getLogger("phalanx.agent")

M = TypeVar("M", bound=Message)
R = TypeVar("R")

REQUEST_BUDGETS = (
    limits.DEFAULT_MAX_REQUEST_BYTES - 64 * 1024,
    1 << 20,
    256 * 1024,
    limits.MIN_MAX_REQUEST_BYTES - 4 * 1024,
    16 * 1024,
)
"""Sizes a report is cut to, one after the other while the master refuses it as too large: the first fits a
master with the default limit, the fourth the smallest limit a master may be given, the last is a last
resort. The agent does not know the master's limit; a refusal costs one round trip."""

_SCALES = (1.0, 1 / 4, 1 / 16, 1 / 64, 0.0)
"""Fractions of the master's per-field limits a failure report is cut to, until it fits its budget."""
MIN_MESSAGE_CHARS = 256
"""The first lines of an error message survive every cut: they name the root cause."""
MIN_TAIL_LINES = 2
"""The last lines of a worker's output survive every cut: without an error file they hold the exception."""


_FIELD_OVERHEAD = 6  # a repeated message field's tag and length prefix, at most, for entries under 4 GiB


def _mark(cut: int) -> str:
    return f"\n[... {cut} characters cut by the agent ...]\n"


def head(text: str, chars: int) -> str:
    """``text`` cut to at most ``chars`` characters, keeping its start (and saying how much was cut)."""
    if len(text) <= chars:
        return text
    keep = chars - len(_mark(len(text)))
    if keep <= 0:
        return text[: max(0, chars)]
    return text[:keep] + _mark(len(text) - keep).rstrip("\n")


def head_and_tail(text: str, chars: int) -> str:
    """``text`` cut to at most ``chars`` characters in the middle: a quarter of what is kept from its start
    (where a traceback enters the user's code), the rest from its end (the frames that raised, and the
    exception)."""
    if len(text) <= chars:
        return text
    room = chars - len(_mark(len(text)))
    if room <= 0:
        return ""
    first = room // 4
    return text[:first] + _mark(len(text) - room) + text[len(text) - (room - first) :]


def cut_failure(failure: pb.WorkerFailure, *, scale: float) -> pb.WorkerFailure:
    """One failure entry cut to ``scale`` times the master's per-field limits (1.0: just the limits)."""
    line_chars = max(MIN_MESSAGE_CHARS, int(limits.MAX_MESSAGE_CHARS * scale))
    tail_lines = max(MIN_TAIL_LINES, math.ceil(limits.MAX_TAIL_LINES * scale))
    out = pb.WorkerFailure()
    out.CopyFrom(failure)
    out.error_message = head(failure.error_message, line_chars)
    out.error_traceback = head_and_tail(failure.error_traceback, int(limits.MAX_TRACEBACK_CHARS * scale))
    out.log_tail[:] = [head(line, line_chars) for line in failure.log_tail[-tail_lines:]]
    return out


def fit_failure_report(request: pb.ReportFailureRequest, budget: int) -> pb.ReportFailureRequest:
    """``request`` cut to the master's per-field limits and to at most ``budget`` bytes: every entry cut
    alike, as little as that takes; when even the shortest entries are too many, the earliest failures
    (the root cause is the first real error: echoes go last) are kept and the rest left out."""
    base = pb.ReportFailureRequest()
    base.CopyFrom(request)
    del base.failures[:]
    out = pb.ReportFailureRequest()
    for scale in _SCALES:
        out.CopyFrom(base)
        out.failures.extend(cut_failure(f, scale=scale) for f in request.failures)
        if out.ByteSize() <= budget:
            return out
    ordered = sorted(out.failures, key=_cause_first)
    kept = pb.ReportFailureRequest()
    kept.CopyFrom(out)
    del kept.failures[:]
    size = kept.ByteSize()
    for entry in ordered:
        size += entry.ByteSize() + _FIELD_OVERHEAD
        if size > budget and kept.failures:
            break
        kept.failures.append(entry)
    return kept


def _cause_first(f: pb.WorkerFailure) -> tuple[int, float, int]:
    """Orders a report's entries as the master picks the root cause: real failures before the
    communication errors that echo them, then by time (see :mod:`phalanx.diagnostics.rootcause`)."""
    try:
        cls = FailureClass(f.failure_class).name.lower()
    except ValueError:
        cls = "unknown"
    return (
        rootcause.tier(cls, f.error_message or "\n".join(f.log_tail[-2:])),
        f.error_unix_ns or f.observed_unix_ns or math.inf,
        f.rank,
    )


def fit_stacks_report(request: pb.ReportStacksRequest, budget: int) -> pb.ReportStacksRequest:
    """``request`` with each rank's stacks cut (their start kept) to an equal share of the master's limit
    on all stacks together and of ``budget`` bytes."""
    out = pb.ReportStacksRequest()
    out.CopyFrom(request)
    share = min(limits.MAX_STACKS_CHARS, budget) // max(1, len(request.ranks))
    while True:
        for cut, whole in zip(out.ranks, request.ranks, strict=True):
            cut.stacks = head(whole.stacks, share)
        total = sum(len(r.stacks) for r in out.ranks)
        if (out.ByteSize() <= budget and total <= limits.MAX_STACKS_CHARS) or share == 0:
            return out
        share //= 2


def send_fitted(send: Callable[[M], R], request: M, fit: Callable[[M, int], M], *, what: str) -> R:
    """Sends ``request`` cut by ``fit`` to the first of :data:`REQUEST_BUDGETS`, and again cut to the next
    while the master refuses it as too large; raises the last refusal when even the shortest is refused."""
    for i, budget in enumerate(REQUEST_BUDGETS):
        cut = fit(request, budget)
        try:
            return send(cut)
        except RequestTooLargeError:
            if i == len(REQUEST_BUDGETS) - 1:
                raise
            log.warning(
                "%s: the master refused %d bytes as too large; sending it cut shorter", what, cut.ByteSize()
            )
    raise AssertionError("not reached")
