"""The real ``phalanx master`` process driven over real gRPC and HTTP by two fake agents."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from phalanx.api.v1 import master_pb2 as pb

from .procs import AUTH, TOKEN, Agent, Master

pytestmark = pytest.mark.integration

FAST = ("--nodes", "2:2", "--heartbeat-interval", "1", "--heartbeat-timeout", "3", "--last-call", "0.3")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    m = Master(tmp_path, *FAST)
    yield m
    m.stop(signal.SIGKILL)


def form_round(a: Agent, b: Agent) -> tuple[pb.GetRendezvousResponse, pb.GetRendezvousResponse]:
    ra = a.join(5001)
    rb = b.join(5002)
    assert ra == rb
    results: dict[str, pb.GetRendezvousResponse] = {}
    t = threading.Thread(target=lambda: results.__setitem__("b", b.get(rb)))
    t.start()
    results["a"] = a.get(ra)
    t.join(15)
    return results["a"], results["b"]


@pytest.mark.timeout(60)
def test_two_agents_rendezvous_fail_rejoin_complete(master: Master) -> None:
    a, b = Agent(master, "node-a"), Agent(master, "node-b")
    reg = a.register()
    assert (reg.heartbeat_interval_s, reg.heartbeat_timeout_s, reg.round) == (1.0, 3.0, 0)
    b.register()
    # long-poll: alone (min 2), b is held for wait_s and answered WAITING ...
    t0 = time.monotonic()
    assert b.get(b.join(5002), wait_s=0.4).status == pb.RENDEZVOUS_STATUS_WAITING
    assert 0.35 <= time.monotonic() - t0 < 3.0
    # ... and a held call is answered as soon as the round completes
    held: list[pb.GetRendezvousResponse] = []
    waiter = threading.Thread(target=lambda: held.append(b.get(1, wait_s=20)))
    waiter.start()
    time.sleep(0.3)
    t_join = time.monotonic()
    a.join(5001)
    waiter.join(15)
    assert time.monotonic() - t_join < 2.0  # max nodes reached: answered at once, far below wait_s
    gb, ga = held[0], a.get(1)
    assert ga.status == gb.status == pb.RENDEZVOUS_STATUS_COMPLETE
    assert (ga.round, ga.world_size, gb.group_rank, ga.group_rank) == (1, 4, 0, 1)  # join order
    assert (ga.store_host, ga.store_port, ga.rank_offset) == ("127.0.0.1", 5002, 2)  # b is group rank 0
    assert a.heartbeat(step=5) == []
    assert b.heartbeat(step=7) == []
    job = master.job()
    assert (job["phase"], job["round"], job["members"], job["max_step"]) == (
        "Running",
        1,
        ["node-b", "node-a"],
        7,
    )

    # a worker of b fails: b is told to rejoin in the response, a in its next heartbeat
    action = b.fail(rank=3, message="RuntimeError: connection reset")
    assert (action.kind, action.round) == (pb.ACTION_KIND_REJOIN, 2)
    hb = a.heartbeat()
    assert [x.kind for x in hb] == [pb.ACTION_KIND_REJOIN]
    job = master.job()
    assert (job["phase"], job["restart_count"]) == ("Restarting", 1)
    assert job["root_cause"]["rank"] == 3
    assert job["root_cause"]["log_tail"] == ["line 1", "line 2"]
    ga, gb = form_round(a, b)
    assert (ga.round, ga.restart_count, [m.node_id for m in ga.members]) == (2, 1, ["node-b", "node-a"])

    # logs: kept per rank, cut to the line limit server-side
    lines = [pb.LogLine(rank=2, text=f"loss {i}", stream=pb.LOG_STREAM_STDOUT) for i in range(3)]
    lines.append(pb.LogLine(rank=2, text="x" * 10_000, stream=pb.LOG_STREAM_STDERR))
    master.stub.ReportLogs(
        pb.ReportLogsRequest(node_id="node-b", incarnation=b.incarnation, lines=lines, dropped=4),
        metadata=AUTH,
        timeout=10,
    )
    got = master.client.get("/v1/logs", params={"node": "node-b", "rank": 2, "tail": 10}).json()["lines"]
    assert [g["text"] for g in got[:3]] == ["loss 0", "loss 1", "loss 2"]
    assert len(got[3]["text"]) == 4096
    assert got[3]["stream"] == "err"

    # checkpoints: committed once all 4 ranks persisted; probes show up per node
    for agent, ranks in ((a, [0, 1]), (b, [2, 3])):
        resp = master.stub.ReportCheckpoint(
            pb.ReportCheckpointRequest(
                node_id=agent.node_id,
                incarnation=agent.incarnation,
                step=40,
                state=pb.CHECKPOINT_STATE_PERSISTED,
                ranks=ranks,
                world_size=4,
            ),
            metadata=AUTH,
            timeout=10,
        )
    assert resp.committed_checkpoint_step == 40
    master.stub.ReportProbe(
        pb.ReportProbeRequest(
            node_id="node-a",
            incarnation=a.incarnation,
            probe=pb.PROBE_KIND_MATMUL,
            measurements=[pb.ProbeMeasurement(ok=True, elapsed_s=0.5, rate=12.5)],
        ),
        metadata=AUTH,
        timeout=10,
    )
    probes = master.client.get("/v1/nodes").json()["nodes"][0]["probes"]
    assert probes["matmul"][0]["rate"] == 12.5
    assert master.job()["committed_checkpoint_step"] == 40

    assert a.complete().kind == pb.ACTION_KIND_NONE
    done = b.complete()
    assert (done.kind, done.exit_code) == (pb.ACTION_KIND_EXIT, 0)
    exit_a = a.heartbeat()
    assert [(x.kind, x.exit_code) for x in exit_a] == [(pb.ACTION_KIND_EXIT, 0)]
    job = master.job()
    assert job["phase"] == "Succeeded"
    kinds = [e["kind"] for e in master.events()]
    for expected in ("node_registered", "round_complete", "failure", "restart", "job_succeeded"):
        assert expected in kinds
    seqs = [e["seq"] for e in master.events()]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    assert master.events(since=seqs[-2]) == master.events()[-1:]
    nodes = master.client.get("/v1/nodes").json()["nodes"]
    assert [(n["node_id"], n["member"], n["group_rank"]) for n in nodes] == [
        ("node-a", True, 1),
        ("node-b", True, 0),
    ]
    metrics = master.client.get("/metrics").text
    assert "phalanx_restarts_total 1.0" in metrics
    assert 'phalanx_failures_total{failure_class="unknown"} 1.0' in metrics
    assert "phalanx_log_lines_total 4.0" in metrics
    assert "phalanx_log_lines_dropped_total 4.0" in metrics
    assert 'phalanx_rpc_duration_seconds_count{method="Heartbeat"}' in metrics
    # the job log file beside the state file
    log_file = master.stderr_path.parent / "state.log"
    assert "node-b r2 out| loss 1" in log_file.read_text()
    # every master log line carries job, round and node; the token never appears
    stderr = master.stderr()
    assert "job=test-job round=" in stderr
    assert "phalanx.failures" in stderr
    assert master.stop() == 0
    assert TOKEN not in master.stderr()


@contextlib.contextmanager
def pair_in_a_round(tmp: Path, *flags: str) -> Iterator[tuple[Master, Agent, Agent]]:
    """A master started with ``flags`` and two fake agents that formed round 1."""
    m = Master(tmp, *flags)
    try:
        a, b = Agent(m, "node-a"), Agent(m, "node-b")
        a.register(), b.register()
        form_round(a, b)
        yield m, a, b
    finally:
        m.stop(signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_held_heartbeat_is_answered_the_moment_a_new_round_opens(tmp_path: Path) -> None:
    flags = ("--nodes", "2:2", "--heartbeat-interval", "3", "--heartbeat-timeout", "9")
    with pair_in_a_round(tmp_path, *flags) as (_, a, b):
        held: list[tuple[float, list[pb.Action]]] = []

        def hold() -> None:
            started = time.monotonic()
            actions = a.heartbeat(wait_s=3.0)
            held.append((time.monotonic() - started, actions))

        t = threading.Thread(target=hold)
        t.start()
        time.sleep(0.5)
        assert held == []  # nothing to say yet: the master holds the answer
        b.fail(rank=3, message="RuntimeError: boom")  # opens round 2
        t.join(10)
        took, actions = held[0]
        assert [(x.kind, x.round) for x in actions] == [(pb.ACTION_KIND_REJOIN, 2)]
        assert took < 2.5  # pushed with the round, not at the end of the 3 s hold
        # once both joined the round there is nothing to say: the hold runs its course, answered empty
        form_round(a, b)
        started = time.monotonic()
        assert a.heartbeat(wait_s=1.0) == []
        assert time.monotonic() - started >= 0.9


HOLDER = """
import sys, grpc
from phalanx.api.v1 import master_pb2 as pb, master_pb2_grpc as pb_grpc
addr, token, node, inc = sys.argv[1:5]
stub = pb_grpc.MasterStub(grpc.insecure_channel(addr))
req = pb.HeartbeatRequest(node_id=node, incarnation=inc, state=pb.NODE_STATE_RUNNING, round=1, wait_s=60)
auth = (("authorization", "Bearer " + token),)
stub.Heartbeat(req, metadata=auth, timeout=70)  # held for an interval: the channel is up once it returns
print("holding", flush=True)  # from now on a heartbeat is held nearly all the time: the next goes out at once
while True:
    stub.Heartbeat(req, metadata=auth, timeout=70)
"""


@pytest.mark.timeout(60)
def test_an_agent_killed_mid_heartbeat_is_left_out_then_lost_before_the_timeout(tmp_path: Path) -> None:
    flags = ("--nodes", "1:2", "--heartbeat-interval", "1", "--heartbeat-timeout", "10")
    with pair_in_a_round(tmp_path, *flags) as (m, a, b):
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, m.grpc, TOKEN, b.node_id, b.incarnation],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        time.sleep(0.3)  # its heartbeat is now held by the master
        holder.kill()  # SIGKILL: the kernel closes its connection
        killed = time.monotonic()
        holder.wait(10)
        holder.stdout.close()
        m.wait_for(lambda job: job["phase"] == "Restarting", timeout=8.0, what="a new round")
        events = [e["kind"] for e in m.events()]
        assert "node_disconnected" in events, m.events()
        assert "node_lost" not in events
        node_b = next(n for n in m.client.get("/v1/nodes").json()["nodes"] if n["node_id"] == "node-b")
        assert node_b["status"] == "alive"
        assert node_b["disconnected_unix"] is not None
        # the survivor forms the next round alone, without waiting for b
        assert [x.kind for x in a.heartbeat()] == [pb.ACTION_KIND_REJOIN]
        assert a.get(a.join(5001)).status == pb.RENDEZVOUS_STATUS_COMPLETE
        assert m.job()["members"] == ["node-a"]
        # b silent for three intervals while a is heard: lost and evicted, long before the heartbeat timeout,
        # so that a replacement may start
        while time.monotonic() - killed < 8.0 and not m.job()["evictions"]:
            a.heartbeat()
            time.sleep(0.2)
        (eviction,) = m.job()["evictions"]
        assert (eviction["node_id"], eviction["kind"]) == ("node-b", "connection_closed"), eviction
        assert time.monotonic() - killed < 8.0  # the heartbeat timeout is 10 s


@pytest.mark.timeout(60)
def test_the_metrics_token_opens_metrics_and_nothing_else(tmp_path: Path) -> None:
    scrape = "m3trics-" + "z" * 24
    (tmp_path / "metrics-token").write_text(scrape + "\n")
    m = Master(tmp_path, *FAST, "--metrics-token-file", str(tmp_path / "metrics-token"))
    try:
        as_prometheus = {"Authorization": f"Bearer {scrape}"}
        r = httpx.get(f"http://{m.http}/metrics", headers=as_prometheus, timeout=5)
        assert r.status_code == 200
        assert "phalanx_heartbeats_total" in r.text
        for path in ("/healthz", "/v1/job", "/v1/events", "/v1/nodes", "/v1/logs"):
            assert httpx.get(f"http://{m.http}{path}", headers=as_prometheus, timeout=5).status_code == 401
        assert httpx.post(f"http://{m.http}/v1/probe", headers=as_prometheus, timeout=5).status_code == 401
        reg = pb.RegisterNodeRequest(job_id="test-job", node_id="n1", incarnation="i1", nproc_per_node=1)
        with pytest.raises(grpc.RpcError) as err:
            m.stub.RegisterNode(reg, metadata=(("authorization", f"Bearer {scrape}"),), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert m.client.get("/metrics").status_code == 200  # the job token still opens everything
        assert scrape not in m.stderr()
    finally:
        m.stop(signal.SIGKILL)


def test_a_missing_metrics_token_file_leaves_metrics_to_the_job_token(tmp_path: Path) -> None:
    m = Master(tmp_path, *FAST, "--metrics-token-file", str(tmp_path / "absent"))
    try:
        assert m.client.get("/metrics").status_code == 200
        assert "no metrics token at" in m.stderr()
    finally:
        m.stop(signal.SIGKILL)


@pytest.mark.timeout(60)
def test_auth_and_malformed_requests_are_refused_and_master_keeps_serving(master: Master) -> None:
    reg = pb.RegisterNodeRequest(
        job_id="test-job", node_id="n1", incarnation="i1", host="h", nproc_per_node=1
    )
    for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
        with pytest.raises(grpc.RpcError) as err:
            master.stub.RegisterNode(reg, metadata=metadata, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for path in ("/healthz", "/metrics", "/v1/job", "/v1/events", "/v1/nodes", "/v1/logs"):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            assert httpx.get(f"http://{master.http}{path}", headers=headers, timeout=5).status_code == 401

    def refused(call, request, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
        with pytest.raises(grpc.RpcError) as err:
            call(request, metadata=AUTH, timeout=5)
        assert err.value.code() == code, err.value.details()
        return str(err.value.details())

    s = master.stub
    assert "node_id" in refused(
        s.RegisterNode, pb.RegisterNodeRequest(job_id="test-job", incarnation="i", nproc_per_node=1)
    )
    assert "nproc" in refused(
        s.RegisterNode,
        pb.RegisterNodeRequest(job_id="test-job", node_id="n1", incarnation="i", nproc_per_node=-2),
    )
    assert "job" in refused(
        s.RegisterNode,
        pb.RegisterNodeRequest(job_id="other", node_id="n1", incarnation="i", nproc_per_node=1),
    )
    refused(s.Heartbeat, pb.HeartbeatRequest(node_id="ghost", incarnation="i"), grpc.StatusCode.NOT_FOUND)
    s.RegisterNode(reg, metadata=AUTH, timeout=5)
    assert "incarnation" in refused(s.Heartbeat, pb.HeartbeatRequest(node_id="n1", incarnation="bogus"))
    refused(
        s.JoinRendezvous,
        pb.JoinRendezvousRequest(node_id="n1", incarnation="i1", nproc_per_node=1, store_port=0),
    )
    refused(s.GetRendezvous, pb.GetRendezvousRequest(node_id="n1", incarnation="i1", wait_s=float("nan")))
    refused(s.ReportCheckpoint, pb.ReportCheckpointRequest(node_id="n1", incarnation="i1", step=-4))
    many = pb.ReportCheckpointRequest(node_id="n1", incarnation="i1", step=1, held_steps=range(100))
    assert "held_steps" in refused(s.ReportCheckpoint, many)
    huge = pb.ReportLogsRequest(node_id="n1", incarnation="i1", lines=[pb.LogLine(text="y" * (5 << 20))])
    refused(s.ReportLogs, huge, grpc.StatusCode.RESOURCE_EXHAUSTED)
    garbage = master.channel.unary_unary("/phalanx.v1.Master/Heartbeat")
    with pytest.raises(grpc.RpcError):
        garbage(b"\xff\xfe not a protobuf \x00", metadata=AUTH, timeout=5)
    assert master.client.get("/v1/logs", params={"tail": -1}).status_code == 422
    assert master.client.get("/v1/events", params={"since": "x"}).status_code == 422
    # still serving
    assert (
        s.Heartbeat(pb.HeartbeatRequest(node_id="n1", incarnation="i1"), metadata=AUTH, timeout=5).round == 0
    )
    assert master.client.get("/healthz").json() == {"status": "ok", "phase": "Pending"}
    assert master.proc.poll() is None


@pytest.mark.timeout(90)
def test_kill9_master_resumes_same_round_without_new_round(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    first = Master(tmp_path, *FAST, "--heartbeat-timeout", "2", state=state)
    a, b = Agent(first, "node-a"), Agent(first, "node-b")
    a.register()
    b.register()
    ga, _ = form_round(a, b)
    assert ga.round == 1
    ports = first.ports
    first.stop(signal.SIGKILL)
    assert first.proc.returncode == -signal.SIGKILL

    second = Master(tmp_path, *FAST, "--heartbeat-timeout", "2", state=state, ports=ports)
    try:
        assert second.ports == ports  # agents reconnect to the same address
        job = second.job()
        assert (job["phase"], job["round"], job["members"], job["open_round"]) == (
            "Running",
            1,
            ["node-a", "node-b"],
            None,
        )
        a2 = Agent(second, "node-a", incarnation=a.incarnation)
        b2 = Agent(second, "node-b", incarnation=b.incarnation)
        a2.round = b2.round = 1
        for _ in range(6):  # 3 s: longer than the heartbeat timeout, so the grace alone cannot explain it
            assert a2.heartbeat() == []
            assert b2.heartbeat() == []
            time.sleep(0.5)
        job = second.job()
        assert (job["round"], job["open_round"], job["restart_count"]) == (1, None, 0)
        kinds = [e["kind"] for e in second.events()]
        assert "master_resumed" in kinds
        assert "round_open" not in kinds
        # now b goes silent for real: it is lost after the timeout and a is asked to rejoin
        deadline = time.monotonic() + 10
        while True:
            actions = a2.heartbeat()
            if actions:
                break
            assert time.monotonic() < deadline, "a was never asked to rejoin"
            time.sleep(0.3)
        assert [(x.kind, x.round) for x in actions] == [(pb.ACTION_KIND_REJOIN, 2)]
        job = second.job()
        assert job["evictions"][0]["node_id"] == "node-b"
    finally:
        second.stop(signal.SIGKILL)


@pytest.mark.timeout(60)
def test_hang_dumps_stacks_and_names_the_odd_node(master: Master) -> None:
    a, b = Agent(master, "node-a"), Agent(master, "node-b")
    a.register()
    b.register()
    form_round(a, b)
    hang = pb.ReportFailureRequest(
        node_id="node-a",
        incarnation=a.incarnation,
        round=1,
        kind=pb.FAILURE_KIND_HANG,
        failures=[
            pb.WorkerFailure(rank=0, failure_class=pb.FAILURE_CLASS_HANG, error_message="beacon 90s old")
        ],
    )
    assert master.stub.ReportFailure(hang, metadata=AUTH, timeout=10).action.kind == pb.ACTION_KIND_REJOIN
    assert [x.kind for x in b.heartbeat()] == [pb.ACTION_KIND_DUMP_STACKS, pb.ACTION_KIND_REJOIN]
    collective = 'Current thread 0x1 (most recent call first):\n  File "/t/c10d.py", line 9 in all_reduce\n'
    loader = 'Current thread 0x1 (most recent call first):\n  File "/t/data.py", line 3 in next_batch\n'
    for agent, ranks in ((a, {0: collective, 1: collective}), (b, {2: collective, 3: loader})):
        master.stub.ReportStacks(
            pb.ReportStacksRequest(
                node_id=agent.node_id,
                incarnation=agent.incarnation,
                round=1,
                ranks=[pb.RankStacks(rank=r, stacks=s) for r, s in ranks.items()],
            ),
            metadata=AUTH,
            timeout=10,
        )
    job = master.job()
    assert job["hang_analysis"]["odd_nodes"] == ["node-b"]
    assert job["hang_analysis"]["odd_ranks"] == [3]
    assert "hang_analysis" in [e["kind"] for e in master.events()]
    nodes = {n["node_id"]: n for n in master.client.get("/v1/nodes").json()["nodes"]}
    assert (nodes["node-a"]["hang_count"], nodes["node-b"]["hang_count"]) == (0, 1)
