"""Saves at breakpoint settled with the master: nodes straddling a step all persist the one they share
(see :mod:`phalanx.master.state.breakpoints`), through the agent's checkpoint host
(:class:`~phalanx.agent.checkpointing.NodeCheckpointHost`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from phalanx.agent.checkpointing import NodeCheckpointHost
from phalanx.agent.client import RetiredError
from phalanx.api.errors import TransportError
from phalanx.api.v1 import master_pb2 as pb


class Breakpoints:
    """Saves at breakpoint the step the master settles across nodes (:mod:`phalanx.master.state.breakpoints`).

    :meth:`save` reports what this node's ranks hold, then persists the master's step, or this node's
    newest while the master waits for other nodes. A node that goes on gets the master's later request
    (PERSIST_CHECKPOINT, :meth:`persist_asked`); a node leaving a job that ended cannot, so it asks again
    (:meth:`await_agreement`)."""

    def __init__(
        self,
        host: NodeCheckpointHost,
        *,
        report: Callable[[pb.ReportCheckpointRequest], pb.ReportCheckpointResponse],
        node_id: str,
        incarnation: str,
        say: Callable[[str], None],
    ) -> None:
        self._host = host
        self._report = report
        self._node_id = node_id
        self._incarnation = incarnation
        self._say = say
        self.last: tuple[int, list[int]] | None = None
        """The round and ranks of the last save at breakpoint, for the master's requests about it."""
        self.unsettled: pb.ReportCheckpointRequest | None = None
        """The last report the master could not answer yet (other nodes had not reported)."""
        self._pending: threading.Thread | None = None

    def save(self, reason: str, *, round_no: int, ranks: list[int], wait: bool = True) -> None:
        """Persists the broken round's newest in-memory step (round 0: no round ran, nothing to settle).

        With ``wait=False`` it returns once the host queued the step, which pins its snapshots, and the
        write goes on behind: new workers may start and save meanwhile (:meth:`finish_pending`)."""
        self.last = (round_no, ranks)
        self.unsettled = None

        def agree(slot_ranks: list[int], held: list[int], step: int) -> int | None:
            req = pb.ReportCheckpointRequest(
                node_id=self._node_id,
                incarnation=self._incarnation,
                step=step,
                state=pb.CHECKPOINT_STATE_IN_MEMORY,
                ranks=slot_ranks,
                round=round_no,
                held_steps=held,
            )
            try:
                answer = self._report(req)
            except RetiredError:
                raise  # not a failure to reach the master: this node's snapshots must not be persisted
            except TransportError as exc:
                self._say(f"could not tell the master which steps this node holds ({exc}); persisting {step}")
                return None
            if answer.persist_step < 0:
                self.unsettled = req  # the master may settle on another step once the others reported
                return None
            return answer.persist_step

        self.finish_pending()  # one save at breakpoint at a time: its snapshots are pinned until it ends
        try:
            queued = self._host.queue_at_breakpoint(reason, ranks=ranks, agree=agree if round_no else None)
        except RetiredError as exc:
            self._say(f"save at breakpoint ({reason}) skipped: {exc}")
            return
        if queued is None:
            return
        if wait:
            self._host.finish_breakpoint(queued)
            return
        self._pending = threading.Thread(
            target=self._host.finish_breakpoint, args=(queued,), name="breakpoint", daemon=True
        )
        self._pending.start()

    def finish_pending(self) -> None:
        """Waits for a save at breakpoint that :meth:`save` left writing (bounded by its time limit)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()

    def persist_asked(self, action: pb.Action, *, current_ranks: list[int]) -> None:
        """PERSIST_CHECKPOINT, in the background (monitoring and the rendezvous go on). The host pins the
        snapshot as soon as it is queued, so the workers' next save cannot overwrite it."""
        ranks = current_ranks
        if action.round and self.last is not None and self.last[0] == action.round:
            ranks = self.last[1]  # the broken round's ranks, whatever this node runs now
        threading.Thread(
            target=self._host.save_at_breakpoint,
            args=(action.reason or "asked by the master",),
            kwargs={"ranks": ranks, "step": action.step or None},
            daemon=True,
        ).start()

    def await_agreement(self, *, limit_s: float) -> None:
        """Before leaving a job that ended: asks again until the master settles the step (at most
        ``limit_s``), and persists it when it is not the one this node chose."""
        self.finish_pending()
        req, self.unsettled = self.unsettled, None
        if req is None or self.last is None:
            return
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            with contextlib.suppress(TransportError):
                answer = self._report(req)
                if answer.persist_step >= 0:
                    if answer.persist_step != req.step:
                        self._host.save_at_breakpoint(
                            f"step {answer.persist_step}, which every node holds",
                            ranks=self.last[1],
                            step=answer.persist_step,
                        )
                    return
            time.sleep(0.5)
        self._say(f"the nodes did not settle on a step to persist in time; leaving with step {req.step}")
