"""Node membership: the registered nodes, their incarnations and liveness. Pure bookkeeping.

A node is ``alive`` from RegisterNode until it is silent for the heartbeat timeout (``lost``), evicted
(``evicted``) or leaves after the job ended (``exited``). A new incarnation of a node id replaces the old
record; the old incarnation's id is remembered so a late heartbeat from it is told to exit instead of
being mistaken for garbage.

An alive node is ``absent`` when the connection of its held heartbeat closed before the answer and it was
not heard from for a grace period since: its agent process is most likely gone (a SIGKILLed agent's
sockets close at once), so the rendezvous stops waiting for it long before the heartbeat timeout decides
whether it is lost. Still silent a few intervals later, while the master hears the other nodes, it is
``gone``: lost without waiting out the rest of the heartbeat timeout, so that its replacement starts sooner.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sized
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from phalanx.api import views
from phalanx.api.v1 import master_pb2 as pb

__all__ = [
    "ALIVE",
    "EVICTED",
    "LOST",
    "Node",
    "NodeStatus",
    "absent",
    "expired",
    "gone",
    "lost_records_to_drop",
    "registration_refusal",
]


class NodeStatus(StrEnum):
    """Where a node stands in the job (``/v1/nodes``' ``status``, the state file's)."""

    ALIVE = "alive"
    LOST = "lost"
    """Its heartbeats stopped for the timeout (or, its connection closed, for a few intervals), or it left for
    good."""
    EVICTED = "evicted"
    """The job took it out (a failed probe, a slow node, a drain)."""


ALIVE, LOST, EVICTED = NodeStatus.ALIVE, NodeStatus.LOST, NodeStatus.EVICTED


def state_name(state: int) -> str:
    """``running`` for NODE_STATE_RUNNING; ``unknown`` for a value this master does not know (an agent of a
    newer version may send one: proto3 enums are open)."""
    try:
        return str(pb.NodeState.Name(state)).removeprefix("NODE_STATE_").lower()  # type: ignore[arg-type]
    except ValueError:
        return "unknown"


@dataclass(kw_only=True)
class Node:
    """What the master knows about one node agent."""

    node_id: str
    incarnation: str
    host: str = ""
    machine: str = ""
    nproc: int = 1
    agent_version: str = ""
    status: NodeStatus = ALIVE
    registered_unix: float = 0.0
    last_seen: float = 0.0
    state: pb.NodeState.ValueType = pb.NODE_STATE_IDLE
    hb_round: int = 0
    ranks: list[pb.RankProgress] = field(default_factory=list)
    """The latest heartbeat's progress, kept as messages: converting 1,000 heartbeats/s to dicts is waste."""
    agent_restarts: int = 0
    probes: dict[str, list[views.PeerProbe]] = field(default_factory=dict)
    memory_checkpoint_step: int = -1
    pending: list[pb.Action] = field(default_factory=list)
    """One-shot actions (DUMP_STACKS, RUN_PROBE, PERSIST_CHECKPOINT) not yet acknowledged by a heartbeat."""
    sent_seq: int = 0
    """The newest action seq put in an answer: a pending action at or below it is being sent again."""
    exit_reason: str = ""
    old_incarnations: list[str] = field(default_factory=list)
    disconnected_at: float = 0.0
    """When a held heartbeat's connection closed before its answer (0: never). Any request since clears it."""
    absence_handled: float = 0.0
    """The ``disconnected_at`` the master already acted on, so that one disconnection opens one round."""
    leaving: bool = False
    """Its last heartbeat said the agent is exiting (NODE_STATE_LEAVING): absent at once, no grace."""
    restored_at: float = 0.0
    """When a restarted master restored it from its state (0: it registered with this master)."""

    def heard(self, req: pb.HeartbeatRequest, ranks: list[pb.RankProgress], *, now: float) -> int:
        """What the node's heartbeat says of it (the job's writer applies it), ``ranks`` being its ranks as
        read once; the number of acknowledged one-shot actions that had been sent before (answers lost on
        the way)."""
        repeated = 0
        if self.pending:
            self.pending[:] = [a for a in self.pending if a.seq > req.acked_seq]
            repeated = sum(1 for a in self.pending if a.seq <= self.sent_seq)
        self.last_seen = now
        self.state = req.state
        leaving = req.state == pb.NODE_STATE_LEAVING
        if leaving and not self.leaving:
            self.disconnected_at = now  # the absence is handled once, as a disconnection's is
        self.leaving = leaving
        self.hb_round = req.round
        self.agent_restarts = req.restart_count
        if ranks:
            self.ranks = ranks
        return repeated

    def durable(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "host": self.host,
            "machine": self.machine,
            "nproc": self.nproc,
            "status": self.status,
            "exit_reason": self.exit_reason,
            "old_incarnations": self.old_incarnations[-8:],
        }

    @classmethod
    def from_durable(cls, node_id: str, data: dict[str, Any], *, now: float) -> Node:
        # last_seen = now: a restarted master gives every node one heartbeat timeout to reappear.
        return cls(
            node_id=node_id,
            incarnation=str(data["incarnation"]),
            host=str(data.get("host", "")),
            machine=str(data.get("machine", "")),
            nproc=int(data.get("nproc", 1)),
            status=NodeStatus(str(data.get("status", ALIVE))),
            exit_reason=str(data.get("exit_reason", "")),
            old_incarnations=[str(i) for i in data.get("old_incarnations", [])],
            registered_unix=now,
            last_seen=now,
            restored_at=now,
        )

    def view(
        self, *, now: float, group_rank: int | None, hang_count: int, straggler: views.Straggler | None
    ) -> views.NodeView:
        """The node as ``/v1/nodes`` shows it; ``group_rank`` None: not a member of the round."""
        return views.NodeView(
            node_id=self.node_id,
            incarnation=self.incarnation,
            host=self.host,
            machine=self.machine,
            nproc=self.nproc,
            agent_version=self.agent_version,
            status=self.status.value,
            state=state_name(self.state),
            round=self.hb_round,
            last_heartbeat_unix=self.last_seen,
            heartbeat_age_s=max(0.0, now - self.last_seen),
            disconnected_unix=self.disconnected_at if self.disconnected_at > self.last_seen else None,
            ranks=[
                views.RankView(
                    rank=r.rank,
                    local_rank=r.local_rank,
                    step=r.step,
                    step_unix=r.step_unix_ns / 1e9,
                    beacon_age_s=r.beacon_age_s,
                    pid=r.pid,
                )
                for r in self.ranks
            ],
            agent_restarts=self.agent_restarts,
            memory_checkpoint_step=self.memory_checkpoint_step,
            probes=self.probes,
            exit_reason=self.exit_reason,
            member=group_rank is not None,
            group_rank=-1 if group_rank is None else group_rank,
            hang_count=hang_count,
            straggler=straggler,
        )


def absent(nodes: Iterable[Node], *, now: float, grace_s: float) -> list[str]:
    """Ids of live nodes whose agent said it is leaving, or whose connection closed more than ``grace_s`` ago
    and that were not heard from since (a live agent whose connection broke sends its next heartbeat within
    the grace)."""
    return [
        n.node_id
        for n in nodes
        if n.status == ALIVE
        and (n.leaving or (n.disconnected_at > n.last_seen and now - n.disconnected_at > grace_s))
    ]


def gone(nodes: Collection[Node], *, now: float, after_s: float) -> list[str]:
    """Ids of live nodes whose connection closed more than ``after_s`` ago and that were not heard from since,
    while the master heard from another node after that closing. A live agent whose connection broke sends
    its next heartbeat within an interval; one silent for several is gone (a SIGKILLed agent's, a crashed
    node's sockets close at once), and waiting out the heartbeat timeout for it only delays its replacement.
    When no other node was heard since, the master's own network may be what broke: the heartbeat timeout
    decides, as it does for plain silence (a cut cable closes no connection)."""
    closed = [
        n
        for n in nodes
        if n.status == ALIVE and n.disconnected_at > n.last_seen and now - n.disconnected_at > after_s
    ]
    if not closed:
        return []
    newest = max(n.last_seen for n in nodes if n.status == ALIVE)
    return [n.node_id for n in closed if newest > n.disconnected_at]


def unheard_since_restore(nodes: Iterable[Node], *, now: float, grace_s: float) -> list[str]:
    """Ids of live nodes that a restarted master restored and has not heard from in the ``grace_s`` since.
    A live agent reaches a restarted master within about a heartbeat interval (it retries every interval);
    one that has not may have died while the master was down, which only its heartbeat timeout will tell."""
    return [
        n.node_id
        for n in nodes
        if n.status == ALIVE
        and n.restored_at
        and n.last_seen <= n.restored_at
        and now - n.restored_at > grace_s
    ]


def expired(nodes: Iterable[Node], *, now: float, timeout_s: float) -> list[str]:
    """Ids of live nodes silent for longer than the heartbeat timeout."""
    return [n.node_id for n in nodes if n.status == ALIVE and now - n.last_seen > timeout_s]


KEPT_LOST_RECORDS = 64
"""Lost nodes' records a master keeps for its views; older ones that are no round member are dropped."""


def registration_cap(max_nodes: int) -> int:
    """How many live node records a job accepts: its members, as many spares again, and a few agents
    reconnecting under new ids. Anyone holding the job token can call RegisterNode, so without a cap a script
    could grow the master without bound; a real job never comes near it."""
    return 2 * max_nodes + 8


def registration_refusal(nodes: Iterable[Node], *, node_id: str, max_nodes: int) -> str:
    """Why a registration under a node id the master does not know is refused; empty when it is accepted."""
    cap = registration_cap(max_nodes)
    if isinstance(nodes, Sized) and len(nodes) < cap:
        return ""  # fewer records than the cap, live or not: no need to count them at every registration
    live = sum(1 for n in nodes if n.status != LOST and n.node_id != node_id)
    if live < cap:
        return ""
    return (
        f"the job has {live} registered nodes, the most it accepts ({cap}: twice rendezvous.maxNodes "
        f"{max_nodes}, plus 8); node {node_id!r} is refused"
    )


def lost_records_to_drop(
    nodes: Iterable[Node], *, members: Iterable[str], keep: int = KEPT_LOST_RECORDS
) -> list[str]:
    """Ids of lost nodes beyond the ``keep`` most recently seen, members of no round: nodes that registered
    and went silent must not accumulate either."""
    lost = [n for n in nodes if n.status == LOST]
    if len(lost) <= keep:
        return []  # the common case, decided without the members (this runs at every registration)
    member_ids = set(members)
    kept = sorted((n for n in lost if n.node_id not in member_ids), key=lambda n: n.last_seen, reverse=True)
    return [n.node_id for n in kept[keep:]]
