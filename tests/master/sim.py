"""A driver for :class:`phalanx.master.job.Job` with an injected clock (no sockets, no sleeps)."""

from __future__ import annotations

from typing import Any

from phalanx.api.settings import MasterSettings, from_mapping
from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.job import Job


def settings(**groups: Any) -> MasterSettings:
    values: dict[str, Any] = {"job_id": "job"}
    values.update(groups)
    return from_mapping(MasterSettings, values)


def failure_report(
    node: str, incarnation: str, round: int, *, kind: int, cls: int, message: str, rank: int, now: float
) -> pb.ReportFailureRequest:
    """What an agent sends when one of its workers (``rank``) failed, as seen at ``now``."""
    return pb.ReportFailureRequest(
        node_id=node,
        incarnation=incarnation,
        round=round,
        kind=kind,  # type: ignore[arg-type]
        failures=[
            pb.WorkerFailure(
                rank=rank,
                exit_code=1,
                failure_class=cls,  # type: ignore[arg-type]
                error_message=message,
                observed_unix_ns=int(now * 1e9),
            )
        ],
    )


class Sim:
    def __init__(self, job: Job | None = None, **groups: Any) -> None:
        self.now = 1000.0
        self.job = job or Job(settings=settings(**groups), now=self.now)
        self.inc: dict[str, str] = {}
        self.acked: dict[str, int] = {}
        """Per node, the highest one-shot action seq received, acknowledged as a real agent does."""

    def at(self, t: float) -> Sim:
        self.now = t
        self.job.tick(now=t)
        return self

    def register(self, node: str, *, inc: str | None = None, nproc: int = 2) -> pb.RegisterNodeResponse:
        self.inc[node] = inc or f"{node}-i1"
        req = pb.RegisterNodeRequest(
            job_id="job", node_id=node, incarnation=self.inc[node], host=f"host-{node}", nproc_per_node=nproc
        )
        return self.job.register(req, now=self.now)

    def join(self, node: str, *, port: int = 2000, nproc: int = 2) -> int:
        req = pb.JoinRendezvousRequest(
            node_id=node,
            incarnation=self.inc[node],
            nproc_per_node=nproc,
            store_host=f"host-{node}",
            store_port=port,
            last_round=self.job.round_number,
        )
        return self.job.join(req, now=self.now).round

    def get(self, node: str, round: int) -> pb.GetRendezvousResponse:
        req = pb.GetRendezvousRequest(node_id=node, incarnation=self.inc[node], round=round)
        return self.job.get_rendezvous(req, now=self.now).response

    def hb(
        self, node: str, *, state: int = pb.NODE_STATE_RUNNING, step: int | None = None, lost: bool = False
    ) -> list[pb.Action]:
        """One heartbeat of ``node``; returns the actions its agent carries out (each seq once), or none
        when the answer is ``lost`` on the way back. With ``step`` it reports one worker at that step (-1: a
        worker that has not completed one)."""
        ranks = [pb.RankProgress(rank=0, step=step)] if step is not None else []
        acked = self.acked.get(node, 0)
        req = pb.HeartbeatRequest(
            node_id=node,
            incarnation=self.inc[node],
            state=state,
            round=self.job.round_number,
            ranks=ranks,
            acked_seq=acked,
        )
        answer = list(self.job.heartbeat(req, now=self.now).actions)
        if lost:
            return []
        fresh = [a for a in answer if not a.seq or a.seq > acked]
        self.acked[node] = max([acked, *(a.seq for a in fresh)])
        return fresh

    def disconnect(self, node: str) -> None:
        """The connection of ``node``'s held heartbeat closed before its answer."""
        req = pb.HeartbeatRequest(node_id=node, incarnation=self.inc[node], wait_s=1.0)
        self.job.disconnected(req, now=self.now)

    def fail(
        self, node: str, *, rank: int = 0, cls: int = pb.FAILURE_CLASS_KILLED, msg: str = "", kind: int = 1
    ) -> pb.Action:
        req = failure_report(
            node,
            self.inc[node],
            self.job.round_number,
            kind=kind,
            cls=cls,
            message=msg,
            rank=rank,
            now=self.now,
        )
        return self.job.report_failure(req, now=self.now)

    def persisted(
        self, node: str, *, step: int, ranks: list[int], world_size: int = 4
    ) -> pb.ReportCheckpointResponse:
        """``node`` persisted its shards (``ranks``) of ``step``."""
        req = pb.ReportCheckpointRequest(
            node_id=node,
            incarnation=self.inc[node],
            step=step,
            state=pb.CHECKPOINT_STATE_PERSISTED,
            ranks=ranks,
            world_size=world_size,
        )
        return self.job.report_checkpoint(req, now=self.now)

    def in_memory(self, node: str, *, round: int, held: list[int]) -> pb.ReportCheckpointResponse:
        """``node`` stopped its workers of ``round`` (a failure, a membership change, SIGTERM); its ranks
        (0-1 on node "a", 2-3 elsewhere) all hold ``held`` in memory; it would persist the newest."""
        req = pb.ReportCheckpointRequest(
            node_id=node,
            incarnation=self.inc[node],
            step=max(held),
            state=pb.CHECKPOINT_STATE_IN_MEMORY,
            ranks=[0, 1] if node == "a" else [2, 3],
            round=round,
            held_steps=held,
        )
        return self.job.report_checkpoint(req, now=self.now)

    def complete(self, node: str) -> pb.Action:
        req = pb.ReportCompletionRequest(
            node_id=node, incarnation=self.inc[node], round=self.job.round_number
        )
        return self.job.report_completion(req, now=self.now)

    def form(self, *nodes: str, wait: float = 1.5) -> int:
        """Registers (if needed) and joins the nodes, lets the last call pass; returns the round."""
        for n in nodes:
            if n not in self.inc:
                self.register(n)
        rounds = {self.join(n, port=2000 + i) for i, n in enumerate(nodes)}
        assert len(rounds) == 1
        self.at(self.now + wait)
        return rounds.pop()


def kinds(actions: list[pb.Action]) -> list[str]:
    return [pb.ActionKind.Name(a.kind).removeprefix("ACTION_KIND_") for a in actions]
