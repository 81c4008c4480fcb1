"""What the agent tells the master about failed or hung workers: each failed rank's exit code, error
file, log tail and failure class (the entries of a ReportFailure request), and the stacks of hung ranks
(ReportStacks)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from phalanx.agent import errorfile, workers
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang
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
) -> pb.WorkerFailure:
    """What one failed or hung worker reports: exit code, error file, log tail and failure class."""
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
        observed_unix_ns=time.time_ns(),
        error_message=(report.message if report else "") or (reason if hung else ""),
        error_traceback=report.traceback if report else "",
        error_unix_ns=report.unix_ns if report else 0,
        log_tail=tail,
        last_step=history.last_step if history else -1,
    )


def rank_stacks(
    running: Mapping[int, workers.Worker], histories: Mapping[int, hang.RankHistory], *, now: float
) -> list[pb.RankStacks]:
    """Dumps the stacks of the ``running`` workers (SIGUSR1), with each rank's last step and beacon age."""
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
            )
        )
    return entries
