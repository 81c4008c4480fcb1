"""A probe round in the real ``phalanx master`` process, driven over real gRPC and HTTP by three fake
agents: POST /v1/probe, RUN_PROBE in heartbeats, one node's matmul fails, that node is evicted."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from phalanx.api.v1 import master_pb2 as pb

from .procs import AUTH, Agent, Master

pytestmark = pytest.mark.integration

ARGS = (
    "--nodes",
    "3:3",
    "--heartbeat-interval",
    "1",
    "--heartbeat-timeout",
    "5",
    "--last-call",
    "0.3",
    "--probes-enabled",
    "true",
    "--probes-timeout-s",
    "20",
)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    m = Master(tmp_path, *ARGS)
    yield m
    m.stop(signal.SIGKILL)


def report(agent: Agent, action: pb.Action, measurements: list[pb.ProbeMeasurement]) -> None:
    req = pb.ReportProbeRequest(
        node_id=agent.node_id,
        incarnation=agent.incarnation,
        probe=action.probe,
        measurements=measurements,
        probe_round=action.probe_round,
    )
    agent.stub.ReportProbe(req, metadata=AUTH, timeout=10)


@pytest.mark.timeout(30)
def test_post_probe_evicts_the_node_whose_matmul_failed(master: Master) -> None:
    agents = [Agent(master, f"node-{x}") for x in "abc"]
    for i, agent in enumerate(agents):
        agent.register()
        agent.join(5001 + i)
    threads = [threading.Thread(target=agent.get, args=(1,)) for agent in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    job = master.job()
    assert job["phase"] == "Running"
    members = job["members"]

    anonymous = httpx.post(f"http://{master.http}/v1/probe", timeout=10)
    assert anonymous.status_code == 401
    started = master.client.post("/v1/probe")
    assert started.status_code == 202, started.text
    probe_id = started.json()["probe"]["id"]
    assert master.client.post("/v1/probe").status_code == 409  # one at a time

    bad = agents[2]
    for agent in agents:
        actions = [a for a in agent.heartbeat(step=3) if a.kind == pb.ACTION_KIND_RUN_PROBE]
        assert [a.probe for a in actions] == [pb.PROBE_KIND_MATMUL, pb.PROBE_KIND_ALLGATHER]
        assert {a.probe_round for a in actions} == {probe_id}
        gather = actions[1]
        assert list(gather.probe_group) == members
        assert (gather.probe_store_addr, gather.probe_store_port) == ("127.0.0.1", 5002)  # rank 0's +1
        ok = agent is not bad
        report(
            agent,
            actions[0],
            [pb.ProbeMeasurement(ok=ok, rate=20.0, elapsed_s=1.0, error="" if ok else "wrong result")],
        )
        me = members.index(agent.node_id)
        peers = {members[(me + 1) % 3], members[(me - 1) % 3]}
        report(
            agent,
            gather,
            [pb.ProbeMeasurement(peer_node_id=p, ok=True, rate=5.0, elapsed_s=0.5) for p in sorted(peers)],
        )

    job = master.wait_for(
        lambda j: j["eviction_count"] == 1, timeout=10, what="the eviction of the failed node"
    )
    [eviction] = job["evictions"]
    assert (eviction["node_id"], eviction["kind"]) == (bad.node_id, "probe_failed")
    assert "wrong result" in eviction["reason"]
    assert job["probe"]["result"] == "evicted"
    assert job["probe"]["evicted"] == [bad.node_id]
    assert job["phase"] == "Restarting"
    assert [a.kind for a in bad.heartbeat()] == [pb.ACTION_KIND_EXIT]
    kinds = [e["kind"] for e in master.events()]
    assert {"probe_started", "probe_failed", "probe_finished", "eviction_requested"} <= set(kinds)
    metrics = master.client.get("/metrics").text
    assert 'phalanx_probe_rounds_total{result="evicted"} 1.0' in metrics
    assert 'phalanx_evictions_total{reason="probe_failed"} 1.0' in metrics
    assert "node=node-c eviction requested: " in master.stderr()  # the event, logged in its words
