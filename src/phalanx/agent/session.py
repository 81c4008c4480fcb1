"""The agent's calls that must get through to the master: registering, retrying while the master is away
(restarting, rescheduled), and joining rendezvous rounds. The supervisor decides what a round means for
its workers; this module only gets one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from phalanx import __version__
from phalanx.agent.client import MasterClient, MasterUnavailableError, UnknownNodeError, backoff_s
from phalanx.agent.config import AgentConfig
from phalanx.api import ports
from phalanx.api.errors import RendezvousClosedError, TransportError
from phalanx.api.round import RoundInfo
from phalanx.api.v1 import master_pb2 as pb

T = TypeVar("T")

MASTER_AWAY_LIMIT_S = 600.0  # how long blocking calls keep retrying a master that does not answer


class MasterSession:
    """One incarnation of a node, as the master knows it."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        client: MasterClient,
        incarnation: str,
        machine: str,
        say: Callable[[str], None],
    ) -> None:
        self.config = config
        self.client = client
        self.incarnation = incarnation
        self.machine = machine
        self.say = say
        self.last_round = 0
        """The newest round this node was a member of (a rejoining node tells the master)."""
        self.on_reregistered: Callable[[], None] = lambda: None
        """Called after the master, which had forgotten this incarnation, knows it again."""

    def retry(self, call: Callable[[], T], what: str) -> T:
        """Retries a call while the master is away (restarting), re-registering if it forgot us."""
        deadline = time.monotonic() + MASTER_AWAY_LIMIT_S
        attempt = 0
        while True:
            try:
                return call()
            except UnknownNodeError:
                self.say(f"{what}: master does not know this incarnation; registering again")
                self.reregister()
            except MasterUnavailableError as exc:
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"{what}: the master did not answer for {MASTER_AWAY_LIMIT_S:g}s"
                    ) from exc
                if attempt in (0, 5):
                    self.say(f"{what}: master unavailable, retrying with backoff")
            attempt += 1
            time.sleep(backoff_s(attempt))

    def register(self) -> pb.RegisterNodeResponse:
        req = pb.RegisterNodeRequest(
            job_id=self.config.job_id,
            node_id=self.config.node_id,
            incarnation=self.incarnation,
            host=self.config.host,
            nproc_per_node=self.config.nproc_per_node,
            agent_version=__version__,
            machine=self.machine,
        )
        return self.client.register(req)

    def reregister(self) -> None:
        self.register()
        self.on_reregistered()

    def join_round(
        self,
        *,
        previous: RoundInfo | None,
        joined: Callable[[int], None],
        waiting: Callable[[], None],
    ) -> RoundInfo:
        """Joins rendezvous until a round with this node completes. ``joined(round)`` is called once the
        master took the join; ``waiting()`` before each poll and once more on completion (the supervisor
        carries out what arrived meanwhile: an EXIT, a probe, a persist request for the broken round)."""
        while True:
            store_port = _free_port(self.config.host)
            accepted = self.retry(
                lambda port=store_port: self.client.join(  # type: ignore[misc]
                    pb.JoinRendezvousRequest(
                        node_id=self.config.node_id,
                        incarnation=self.incarnation,
                        nproc_per_node=self.config.nproc_per_node,
                        store_host=self.config.host,
                        store_port=port,
                        last_round=self.last_round,
                    )
                ),
                "join rendezvous",
            )
            joined(accepted.round)
            while True:
                waiting()
                resp = self.retry(
                    lambda r=accepted.round: self.client.get_rendezvous(  # type: ignore[misc]
                        pb.GetRendezvousRequest(
                            node_id=self.config.node_id, incarnation=self.incarnation, round=r, wait_s=2.0
                        )
                    ),
                    "rendezvous",
                )
                if resp.status == pb.RENDEZVOUS_STATUS_COMPLETE:
                    waiting()  # before the workers start
                    info = round_info(
                        resp,
                        local_world_size=self.config.nproc_per_node,
                        previous=previous,
                        store_key=self.client.store_key(round_store(resp)),
                    )
                    self.last_round = info.round
                    return info
                if resp.status == pb.RENDEZVOUS_STATUS_CLOSED:
                    raise RendezvousClosedError("the job is over (rendezvous closed)")
                if resp.status == pb.RENDEZVOUS_STATUS_NOT_MEMBER:
                    self.say(f"round {resp.round} completed without this node; joining the next one")
                    time.sleep(0.2)
                    break


def round_store(resp: pb.GetRendezvousResponse) -> str:
    """What a round's store key is derived from: the round and its store, unique within the job."""
    return f"round/{resp.round}/{resp.store_host}:{resp.store_port}"


def round_info(
    resp: pb.GetRendezvousResponse, *, local_world_size: int, previous: RoundInfo | None, store_key: str = ""
) -> RoundInfo:
    """The round as the workers see it; ``joined`` names the members new since ``previous``."""
    members = [m.node_id for m in resp.members]
    before = set(previous.members) if previous else set()
    return RoundInfo(
        round=resp.round,
        group_rank=resp.group_rank,
        rank_offset=resp.rank_offset,
        world_size=resp.world_size,
        local_world_size=local_world_size,
        store_host=resp.store_host,
        store_port=resp.store_port,
        restart_count=resp.restart_count,
        members=members,
        joined=[m for m in members if m not in before] if before else [],
        store_key=store_key,
    )


def _free_port(host: str) -> int:
    """A port free right now on this host, and the next one: the round's c10d store and, should the master
    ask for probes, their store (``store_port + 1``). Fresh for every round so no stale store is reused."""
    try:
        return ports.free_port(host, span=2)
    except OSError:  # the host's name is not an address of this machine's (behind NAT): any address
        return ports.free_port("", span=2)
