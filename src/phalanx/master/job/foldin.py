"""The job's component for checkpoint reports and the fold-in they time: commits, failed saves, the in-memory
snapshots of a save at breakpoint (:mod:`phalanx.master.state.breakpoints`), and nodes that wait beside the
running round until a checkpoint boundary folds them in (:func:`phalanx.master.decide.foldin.decide`).

Pure: every method takes ``now`` and does no I/O.
"""

from __future__ import annotations

import dataclasses

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.decide import foldin
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.errors import RequestError
from phalanx.master.job import effects as fx
from phalanx.master.job.core import JobCore, failure_log, log, rdzv_log
from phalanx.master.state.nodes import ALIVE

__all__ = ["FoldIn"]


class FoldIn:
    """Checkpoint reports, and the nodes waiting beside the running round for a checkpoint boundary."""

    def __init__(self, core: JobCore) -> None:
        self.core = core
        self.state = core.state
        self.fold_in_wait: foldin.Waiting | None = None
        """Nodes wait beside the running round for a checkpoint boundary
        (:mod:`phalanx.master.decide.foldin`)."""
        self.snapshots: foldin.Snapshots | None = None
        """The job's snapshot cadence, from its newest save at breakpoint (not durable: a restarted master
        learns it at the next one, and waits for a commit meanwhile)."""
        self.commit_times: tuple[float, float] = (0.0, 0.0)
        """When the last two steps were committed (0: not yet); their difference bounds a wait for a
        commit."""

    def maybe_fold_in(self, *, now: float) -> None:
        """Opens the round that folds nodes waiting beside the running round in, once it would be larger
        and the job is at a checkpoint boundary (:func:`foldin.decide`); until then the members train on."""
        s = self.state
        if s.round_open or s.finished or s.round is None or not s.joiners:
            self.fold_in_wait = None
            return
        members = s.members
        waiting = sum(1 for n in s.joiners if not s.is_member(n))
        # Once a member finished its work the job is ending: a new round would make every worker train
        # again from its last checkpoint (or from scratch) for nothing. Late joiners wait.
        if s.completed or not rdzv.can_grow(
            members=len(members), waiting=waiting, settings=s.settings.rendezvous
        ):
            self.fold_in_wait = None
            return
        step = self.state.round_step()
        wait = self.fold_in_wait
        fresh = wait is None or wait.round != s.round_number
        if wait is None or wait.round != s.round_number:
            wait = self.fold_in_wait = foldin.Waiting(
                round=s.round_number, since=now, step=step, committed=s.checkpoints.committed
            )
        elif wait.step < 0 <= step:
            # They joined before the round's first step was heard of: the wait is for the boundary after it.
            wait = self.fold_in_wait = dataclasses.replace(wait, step=step)
        before, last = self.commit_times
        decision = foldin.decide(
            waiting=wait,
            now=now,
            step=step,
            committed=s.checkpoints.committed,
            snapshots=self.snapshots,
            commit_period_s=last - before if before > 0 else None,
        )
        if fresh and not decision.now:
            rdzv_log.info(
                "%d node(s) wait beside round %d for a checkpoint boundary (step %d, snapshots %s)",
                waiting,
                s.round_number,
                step,
                f"every {self.snapshots.every} steps" if self.snapshots else "unknown",
                extra={"round": s.round_number},
            )
        if decision.now:
            self.fold_in_wait = None
            self.core.apply(
                [fx.OpenRound(f"scale up: {waiting} node(s) waiting; {decision.reason}")], now=now
            )

    def report_checkpoint(
        self, req: pb.ReportCheckpointRequest, *, now: float
    ) -> pb.ReportCheckpointResponse:
        s, core = self.state, self.core
        node = s.node(req.node_id, req.incarnation)
        persist_step = -1
        if req.state == pb.CHECKPOINT_STATE_PERSISTED:
            committed = s.checkpoints.committed
            core.apply([fx.Persisted(req.step, tuple(req.ranks), req.world_size)], now=now)
            if s.checkpoints.committed > committed:
                message = f"step {req.step} at {req.path}"
                core.apply(
                    [fx.Emit("checkpoint_committed", message, node=req.node_id, log=log.info), fx.Saved()],
                    now=now,
                )
                self.commit_times = (self.commit_times[1], now)
                if self.fold_in_wait is not None:
                    self.maybe_fold_in(now=now)  # a checkpoint was just taken: a boundary
        elif req.state == pb.CHECKPOINT_STATE_FAILED:
            failed = fx.Emit("checkpoint_failed", f"step {req.step}: {req.error}", node=req.node_id)
            core.apply([fx.Tally("checkpoint_failures"), failed], now=now)
            failure_log.warning(
                "persisting checkpoint step %d failed: %s",
                req.step,
                req.error[:1000],
                extra={"node": req.node_id, "round": s.round_number},
            )
        elif req.state == pb.CHECKPOINT_STATE_IN_MEMORY:
            if node.status != ALIVE or req.incarnation != node.incarnation:
                # An evicted node (a bad GPU, a hang) leaves the job's state to the survivors: what it holds
                # must not become part of a committed step.
                raise RequestError(
                    f"{req.node_id} is {node.status}: it leaves the job's state to the survivors",
                    code="failed_precondition",
                )
            core.apply([fx.HeldInMemory(req.node_id, req.step), fx.Saved(durable=False)], now=now)
            self.snapshots = foldin.cadence([req.held_steps]) or self.snapshots
            if req.round > 0:
                persist_step = self._breakpoint_report(req, now=now)
        return pb.ReportCheckpointResponse(
            committed_checkpoint_step=s.checkpoints.committed, persist_step=persist_step
        )

    def _breakpoint_report(self, req: pb.ReportCheckpointRequest, *, now: float) -> int:
        """Records what a node of a broken round holds (see :mod:`phalanx.master.state.breakpoints`); the step
        it must persist, or -1 while some member has not reported."""
        s = self.state
        bp = s.breakpoint
        if bp is None or bp.round < req.round:
            if req.round != s.round_number:
                return -1  # a round that is not the running one: its members are not known any more
        elif bp.round > req.round:
            return -1  # a late report of an older breakpoint
        elif bp.step is not None:  # agreed already (a node reporting twice, or a straggler)
            return bp.step if bp.step in req.held_steps else -1
        report = fx.BreakpointReport(req.node_id, req.round, tuple(req.held_steps), persisting=req.step)
        self.core.apply([report, fx.SettleBreakpoint(answered=req.node_id)], now=now)
        bp = s.breakpoint
        return -1 if bp is None or bp.step is None else bp.step
