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


def raised_before(running: Mapping[int, workers.Worker], *, unix_ns: int) -> dict[int, workers.Worker]:
    """The workers that wrote their error file before ``unix_ns`` (when the agent stopped them): they had
    raised on their own and were still tearing down, which can take seconds on a loaded machine or in an
    NCCL abort. A file written later is the stop's own doing (a SIGTERM handler that raised)."""
    raised = {}
    for lr, w in running.items():
        try:
            written_ns = w.paths.error_file.stat().st_mtime_ns if w.paths else None
        except OSError:
            written_ns = None
        if written_ns is not None and written_ns < unix_ns:
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
