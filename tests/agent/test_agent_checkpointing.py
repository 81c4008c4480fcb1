"""The agent's checkpoint-host lifecycle and probe handling: pure decisions, configuration, and the
real host and probe processes driven through the agent's own code paths."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.agent import checkpointing, probes
from phalanx.agent import config as agent_config
from phalanx.agent.breakpoints import Breakpoints
from phalanx.agent.client import MasterClient, RetiredError
from phalanx.api.errors import ConfigError
from phalanx.api.ports import free_port
from phalanx.api.settings import CheckpointSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.checkpoint import protocol, shm
from phalanx.checkpoint.host import process_running
from tests.agent.helpers import master_process
from tests.eventually import eventually


def _node_files(shm_root: Path) -> list[Path]:
    """Every file the node keeps in its shared-memory root: beacons there, slots in the user's directory."""
    return sorted(p for p in shm_root.rglob("*") if not p.is_dir())


# ------------------------------------------------------------------------------------------------------
# Pure decisions


def test_agreed_step_is_the_newest_step_every_rank_holds() -> None:
    # Rank 0 died mid-save of step 20: it holds 18 and 19, rank 1 holds 19 and 20.
    assert checkpointing.agreed_step({0: {18, 19}, 1: {19, 20}}) == 19
    assert checkpointing.agreed_step({0: {5}, 1: {5}}) == 5
    assert checkpointing.agreed_step({0: {4}, 1: {6}}) is None
    assert checkpointing.agreed_step({0: {4}, 1: set()}) is None
    assert checkpointing.agreed_step({}) is None


def test_breakpoint_ranks_fall_back_to_the_slots_on_the_node() -> None:
    # Checkpointer slots named by global rank: this node's ranks that saved.
    assert checkpointing.breakpoint_ranks(local_ranks=[2, 3], slot_ranks=[0, 1, 2, 3]) == [2, 3]
    assert checkpointing.breakpoint_ranks(local_ranks=[2, 3], slot_ranks=[3]) == [3]
    # The trainer's slots are named by model shard: none matches a global rank of this node.
    assert checkpointing.breakpoint_ranks(local_ranks=[4, 5], slot_ranks=[1, 0]) == [0, 1]
    assert checkpointing.breakpoint_ranks(local_ranks=[0], slot_ranks=[]) == []


def test_probe_plan() -> None:
    matmul = probes.plan(pb.Action(kind=pb.ACTION_KIND_RUN_PROBE, probe=pb.PROBE_KIND_MATMUL), node_id="n0")
    assert matmul.kind == "matmul"
    assert "--seconds" in matmul.args
    assert matmul.timeout_s > 0
    gather = probes.plan(
        pb.Action(
            kind=pb.ACTION_KIND_RUN_PROBE,
            probe=pb.PROBE_KIND_ALLGATHER,
            probe_group=["n0", "n1", "n2"],
            probe_store_addr="10.0.0.1",
            probe_store_port=2222,
        ),
        node_id="n1",
    )
    assert gather.kind == "allgather"
    assert gather.args[gather.args.index("--rank") + 1] == "1"
    assert gather.args[gather.args.index("--store") + 1] == "10.0.0.1:2222"
    outsider = probes.plan(
        pb.Action(kind=pb.ACTION_KIND_RUN_PROBE, probe=pb.PROBE_KIND_ALLGATHER, probe_group=["n0"]),
        node_id="n9",
    )
    assert outsider.kind is None
    assert "not in the probe group" in outsider.error
    unknown = probes.plan(pb.Action(kind=pb.ACTION_KIND_RUN_PROBE), node_id="n0")
    assert unknown.kind is None
    assert "unknown probe kind" in unknown.error


# ------------------------------------------------------------------------------------------------------
# Configuration


def test_checkpoint_flags_and_environment() -> None:
    cfg = agent_config.parse(["--standalone", "train.py"], {})
    assert cfg.checkpoint_host
    assert cfg.checkpoint.storage_path == ""
    env = {"PHALANX_CHECKPOINT_STORAGE_PATH": "/ckpt", "PHALANX_CHECKPOINT_KEEP_LAST": "4"}
    cfg = agent_config.parse(["--standalone", "train.py"], env)
    assert (cfg.checkpoint.storage_path, cfg.checkpoint.keep_last) == ("/ckpt", 4)
    cfg = agent_config.parse(
        ["--standalone", "--checkpoint-dir", "/other", "--checkpoint-keep-last", "1", "train.py"], env
    )
    assert (cfg.checkpoint.storage_path, cfg.checkpoint.keep_last) == ("/other", 1)
    assert not agent_config.parse(["--standalone", "--no-checkpoint-host", "t.py"], {}).checkpoint_host
    assert not agent_config.parse(["--standalone", "t.py"], {"PHALANX_CHECKPOINT_HOST": "0"}).checkpoint_host
    with pytest.raises(ConfigError, match="keep_last"):
        agent_config.parse(["--standalone", "--checkpoint-keep-last", "0", "t.py"], {})


def test_warm_probes_are_on_unless_turned_off_and_apart_from_warm_spares() -> None:
    cfg = agent_config.parse(["--standalone", "--no-warm-spares", "t.py"], {})
    assert (cfg.warm_spares, cfg.warm_probes) == (False, True)
    assert not agent_config.parse(["--standalone", "--no-warm-probes", "t.py"], {}).warm_probes
    assert not agent_config.parse(["--standalone", "t.py"], {"PHALANX_WARM_PROBES": "0"}).warm_probes


# ------------------------------------------------------------------------------------------------------
# The real host, through the agent's lifecycle object


def started_host(
    tmp_path: Path, said: list[str], *, job: str, node_id: str
) -> tuple[checkpointing.NodeCheckpointHost, Path, Path]:
    """The agent's checkpoint host, started with storage ``tmp_path/ckpt`` and shared memory in
    ``tmp_path/shm``; returns it with those two."""
    host = checkpointing.NodeCheckpointHost(said.append)
    storage, shm_root = tmp_path / "ckpt", tmp_path / "shm"
    shm_root.mkdir()
    assert host.start(
        settings=CheckpointSettings(storage_path=str(storage)),
        shm_root=shm_root,
        job_id=job,
        node_id=node_id,
        master_addr="",
        token_file="",
        incarnation="i",
    )
    return host, storage, shm_root


def write_snapshots(socket_path: str, steps_by_rank: dict[int, tuple[int, int]]) -> None:
    """Allocates each rank's two slots from the host and writes an empty snapshot of one step into each,
    the way a Checkpointer writes them (header + raw bytes), torch-free."""
    with contextlib.closing(protocol.HostClient(socket_path)) as client:
        for rank, steps in steps_by_rank.items():
            reply = client.call({"op": "alloc", "rank": rank, "size": 1 << 16})
            for path, step in zip(reply["paths"], steps, strict=True):
                seg = shm.Segment(Path(path))
                meta = json.dumps(
                    {"format": 1, "step": step, "rank": rank, "world_size": 2, "skeleton": {}, "tensors": []}
                ).encode()
                seg.buf[shm.HEADER_SIZE : shm.HEADER_SIZE + len(meta)] = meta
                header = shm.SlotHeader(
                    state=shm.STATE_COMPLETE,
                    seq=step,
                    step=step,
                    meta_len=len(meta),
                    data_off=shm.align(shm.HEADER_SIZE + len(meta), shm.PAGE),
                    data_len=0,
                    rank=rank,
                    world_size=2,
                )
                shm.pack_header(seg.buf, header)
                seg.close()


def test_host_that_cannot_start_is_logged_and_skipped(tmp_path: Path) -> None:
    said: list[str] = []
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the shared-memory root is a file: the node's directory cannot be made
    host = checkpointing.NodeCheckpointHost(said.append)
    started = host.start(
        settings=CheckpointSettings(),
        shm_root=blocker,
        job_id="j",
        node_id="n",
        master_addr="",
        token_file="",
        incarnation="i",
    )
    assert not started
    assert host.env() == {}
    assert host.save_at_breakpoint("test", ranks=[0]) == {}
    host.stop()  # a no-op, not an error
    assert len(said) == 1
    assert said[0].startswith("error: the flash-checkpoint host did not start")


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_host_lifecycle_persists_agreed_step_and_unlinks(tmp_path: Path) -> None:
    said: list[str] = []
    job = f"lifecycle-{os.getpid()}"
    host, storage, shm_root = started_host(tmp_path, said, job=job, node_id="node/0")
    try:
        env = host.env()
        assert env[protocol.ENV_JOB] == f"{job}.node_0"  # per node: agents of one job may share a machine
        assert env[protocol.ENV_STORAGE] == str(storage)
        write_snapshots(env[protocol.ENV_SOCKET], {0: (6, 7), 1: (7, 8)})
        assert checkpointing.held_steps(shm_root, job_id=env[protocol.ENV_JOB], ranks=[0, 1]) == {
            0: {6, 7},
            1: {7, 8},
        }

        # An evicted node (SIGTERMed with its Pod, say) is refused by the master: it persists nothing, so
        # what a bad GPU holds never becomes part of a committed step.
        def retired(req: pb.ReportCheckpointRequest) -> pb.ReportCheckpointResponse:
            raise RetiredError("node/0 is evicted: it leaves the job's state to the survivors")

        breakpoints = Breakpoints(host, report=retired, node_id="node/0", incarnation="i", say=said.append)
        breakpoints.save("terminated", round_no=3, ranks=[4, 5])
        assert not storage.exists() or not list(storage.rglob("*.safetensors")), sorted(storage.rglob("*"))
        assert any("save at breakpoint (terminated) skipped" in line for line in said), said
        # The node's workers are global ranks 4 and 5, but the slots are named 0 and 1 (as the trainer
        # names them, by model shard): the snapshots on the node are persisted all the same.
        result = host.save_at_breakpoint("test", ranks=[4, 5])
        assert result == {"ok": True, "step": 7, "errors": []}, said
        from phalanx.checkpoint import storage as storage_lib

        assert storage_lib.committed_steps(storage_lib.open_storage(str(storage))) == [7]
        assert len(_node_files(shm_root)) == 4
    finally:
        started = time.monotonic()
        host.stop()
    assert time.monotonic() - started < 5
    assert not _node_files(shm_root)
    assert not Path(env[protocol.ENV_SOCKET]).exists()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_queued_save_at_breakpoint_is_pinned_while_new_workers_save(tmp_path: Path) -> None:
    """After a worker failure the agent restarts the workers once the breakpoint step is queued, not
    written: the restarted workers' saves must not overwrite the snapshot the host still has to persist."""
    from phalanx.checkpoint import Checkpointer
    from phalanx.checkpoint import storage as storage_lib

    said: list[str] = []
    host, storage, shm_root = started_host(tmp_path, said, job="pinned", node_id="n0")
    ckpts: list[Checkpointer] = []
    try:
        env = host.env()
        for rank in (0, 1):
            ckpts.append(
                Checkpointer(
                    storage=str(storage), job_id=env[protocol.ENV_JOB], host_socket=env[protocol.ENV_SOCKET],
                    shm_dir=str(shm_root), rank=rank, world_size=2,
                )
            )  # fmt: skip

        def state(step: int, rank: int) -> dict[str, Any]:
            # Rank 1's shard is big: the host is still writing it while rank 0's waits in its queue.
            return {"w": torch.full((1 << 16 if rank == 0 else 1 << 26,), float(step)), "step": step}

        for step in (1, 2, 3):
            for rank, ckpt in enumerate(ckpts):
                ckpt.save(step, state(step, rank))
        queued = host.queue_at_breakpoint("worker failure", ranks=[1, 0])
        assert queued is not None
        assert queued.step == 3
        os.kill(host.handle.pid, signal.SIGSTOP)  # storage is slow: rank 0's step 3 is not written yet
        try:
            for step in (4, 5, 6):  # the restarted workers train on and save
                ckpts[0].save(step, state(step, 0))
        finally:
            os.kill(host.handle.pid, signal.SIGCONT)
        assert host.finish_breakpoint(queued) == {"ok": True, "step": 3, "errors": []}, said
        store = storage_lib.open_storage(str(storage))
        assert storage_lib.committed_steps(store) == [3], said
        (tmp_path / "empty").mkdir()
        loaded = Checkpointer(storage=str(storage), shm_dir=str(tmp_path / "empty"), rank=0, world_size=2)
        step, got = loaded.load()  # type: ignore[misc]
        assert step == 3  # from storage, the new node's way
        assert loaded.last_load["source"] == "storage"
        assert torch.equal(got["w"], state(3, 0)["w"])
        loaded.close()
        # Steps 4 to 6 all went to the other slot: the one holding step 3 stayed pinned until it was written.
        assert checkpointing.held_steps(shm_root, job_id=env[protocol.ENV_JOB], ranks=[0]) == {0: {3, 6}}
    finally:
        for ckpt in ckpts:
            ckpt.close()
        host.stop()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_host_that_dies_or_hangs_is_replaced_with_the_nodes_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpointing, "WATCH_INTERVAL_S", 0.1)
    monkeypatch.setattr(checkpointing, "PING_LIMIT_S", 1.0)
    monkeypatch.setattr(checkpointing, "STOP_LIMIT_S", 2.0)
    said: list[str] = []
    host, _, shm_root = started_host(tmp_path, said, job="watched", node_id="n0")
    pids: list[int] = []
    try:
        sock = host.env()[protocol.ENV_SOCKET]
        job = host.env()[protocol.ENV_JOB]
        write_snapshots(sock, {0: (6, 7)})

        def replaced(problem: str) -> int:
            """Waits for the watcher to replace the host; returns the new host's pid."""
            old = host.handle.pid
            pids.append(old)
            eventually(
                lambda: any(problem in line and "replaced it" in line for line in said),
                timeout=20,
                what=f"the watcher replacing the host that {problem}",
            )
            assert not process_running(old)
            with contextlib.closing(protocol.HostClient(sock)) as client:
                pid = int(client.call({"op": "ping"}, timeout_s=5)["pid"])
            assert pid == host.handle.pid != old
            assert checkpointing.held_steps(shm_root, job_id=job, ranks=[0]) == {0: {6, 7}}
            return pid

        os.kill(host.handle.pid, signal.SIGKILL)
        replaced("exited")
        os.kill(host.handle.pid, signal.SIGSTOP)
        replaced("does not answer")
        assert host.replaced == 2
        assert host.save_at_breakpoint("test", ranks=[0]) == {"ok": True, "step": 7, "errors": []}, said

        # A host that hangs as the agent exits: killed after the stop limit, and its memory removed.
        os.kill(host.handle.pid, signal.SIGSTOP)
        pids.append(host.handle.pid)
        host.stop()
        assert any(f"exited with code {-signal.SIGKILL}" in line for line in said), said
        assert any("removed 2 shared-memory segments the host left behind" in line for line in said), said
    finally:
        host.stop()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not _node_files(shm_root)
    assert not any(process_running(pid) for pid in pids)


# ------------------------------------------------------------------------------------------------------
# Probes: the agent's handling path against a real master and the real matmul probe


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_run_probe_action_reports_matmul_measurements(tmp_path: Path) -> None:
    job = f"probe-{os.getpid()}"
    with master_process(tmp_path, job) as master:
        client = MasterClient(address=master.grpc, token=master.token)
        executor: probes.ProbeExecutor | None = None
        try:
            client.register(
                pb.RegisterNodeRequest(
                    job_id=job, node_id="n0", incarnation="inc-1", host="127.0.0.1", nproc_per_node=1
                )
            )
            said: list[str] = []
            executor = probes.ProbeExecutor(
                client=client, node_id="n0", incarnation="inc-1", env=dict(os.environ), say=said.append
            )
            action = pb.Action(kind=pb.ACTION_KIND_RUN_PROBE, probe=pb.PROBE_KIND_MATMUL, probe_round=3)
            thread = executor.start(action)
            assert thread is not None
            assert executor.start(action) is None  # a repeat of a queued or running probe is ignored
            executor.join(50)
            assert not thread.is_alive()
            report = executor.last_report
            assert report is not None
            assert report.probe_round == 3
            assert [m.ok for m in report.measurements] == [True] * len(report.measurements), said
            assert all(m.rate > 0 for m in report.measurements)
            req = urllib.request.Request(
                f"http://{master.http}/v1/nodes", headers={"Authorization": f"Bearer {master.token}"}
            )
            with urllib.request.urlopen(req, timeout=5) as resp:
                nodes = json.loads(resp.read())["nodes"]
            matmul = nodes[0]["probes"]["matmul"]
            assert matmul
            assert all(m["ok"] and m["rate"] > 0 and m["probe_round"] == 3 for m in matmul)
        finally:
            if executor is not None:
                executor.stop()  # ends its warm probe server
            client.close()


def _offline_executor(said: list[str] | None = None) -> probes.ProbeExecutor:
    return probes.ProbeExecutor(
        client=MasterClient(address="127.0.0.1:1", token="t"),  # nobody: the reports are dropped
        node_id="n0",
        incarnation="inc-1",
        env=dict(os.environ),
        say=(said.append if said is not None else lambda _: None),
    )


def _lonely_allgather(probe_round: int) -> pb.Action:
    """An all-gather probe with a peer that never comes: it waits 30 s for it."""
    port = free_port()
    return pb.Action(
        kind=pb.ACTION_KIND_RUN_PROBE,
        probe=pb.PROBE_KIND_ALLGATHER,
        probe_group=["n0", "ghost"],
        probe_store_addr="127.0.0.1",
        probe_store_port=port,
        probe_round=probe_round,
    )


def _waitprocess_running(executor: probes.ProbeExecutor) -> None:
    """The first probe starts the warm probe server, which imports torch before it forks the probe: a
    second on an idle machine, tens of seconds under a full suite's load."""
    eventually(lambda: executor._kill is not None, timeout=60, what="the probe starting", interval=0.01)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_stop_kills_a_running_probe() -> None:
    """An agent that leaves stops its probe: in a session of its own, it would outlive the agent, waiting
    here 30 s for a peer that never comes (and on a real job in a collective with peers that left)."""
    executor = _offline_executor()
    try:
        thread = executor.start(_lonely_allgather(4))
        assert thread is not None
        _waitprocess_running(executor)
    finally:
        executor.stop()  # also when the probe never started: no server or probe outlives the test
    executor.join(10)
    assert not thread.is_alive()
    report = executor.last_report
    assert report is not None
    assert [m.ok for m in report.measurements] == [False]
    assert "killed by signal 9" in report.measurements[0].error
    assert executor.start(_lonely_allgather(5)) is None  # a stopped executor starts nothing


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_newer_round_ends_the_stale_probe_and_runs_its_own() -> None:
    """The master closed round 4 (it timed out) and started round 5: the all-gather of round 4, still
    waiting for its peer, is killed rather than keeping round 5's probes waiting for half a minute."""
    said: list[str] = []
    executor = _offline_executor(said)
    try:
        executor.start(_lonely_allgather(4))
        _waitprocess_running(executor)
        started = time.monotonic()
        executor.start(pb.Action(kind=pb.ACTION_KIND_RUN_PROBE, probe=pb.PROBE_KIND_MATMUL, probe_round=5))
        executor.join(50)
    finally:
        executor.stop()
    assert any("killed by signal 9" in line for line in said), said  # the stale all-gather
    assert time.monotonic() - started < 25, said  # not after the stale probe's 30 s wait for its peer
    report = executor.last_report
    assert report is not None
    assert (report.probe_round, report.probe) == (5, pb.PROBE_KIND_MATMUL)
    assert [m.ok for m in report.measurements] == [True], said
    assert any("allgather of probe round 4 is stale" in line for line in said), said


# An agent's checkpoint-host lifecycle in a process of its own, so a test can SIGKILL it: it starts the
# node's host, reports it, and lives until killed.
_AGENT = (
    "import json, sys, time\n"
    "from pathlib import Path\n"
    "from phalanx.agent import checkpointing as c\n"
    "from phalanx.api.settings import CheckpointSettings\n"
    "from phalanx.checkpoint import protocol\n"
    "h = c.NodeCheckpointHost(lambda line: print(line, file=sys.stderr))\n"
    "assert h.start(settings=CheckpointSettings(), shm_root=Path(sys.argv[1]), job_id=sys.argv[2],"
    " node_id='n', master_addr='', token_file='', incarnation='i', release_also=[Path(sys.argv[3])])\n"
    "print(json.dumps({'pid': h.handle.pid, 'socket': h.env()[protocol.ENV_SOCKET],"
    " 'job': h.handle.job_id}), flush=True)\n"
    "time.sleep(120)\n"
)


def _start_agent(shm_root: Path, job_id: str, beacon: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, str(shm_root), job_id, str(beacon)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert agent.stdout is not None
    line = agent.stdout.readline()
    if not line:
        agent.wait()
        raise AssertionError(f"the agent exited {agent.returncode} before its host ran")
    return agent, json.loads(line)


def _kill_agent(agent: subprocess.Popen[str]) -> None:
    """SIGKILL to the agent's whole process group (a node kill in ``phalanx local``)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    if agent.stdout is not None:
        agent.stdout.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_gone(pid: int, timeout_s: float, what: str) -> None:
    eventually(lambda: _gone(pid), timeout=timeout_s, what=what, interval=0.1)


@pytest.mark.integration
@pytest.mark.timeout(40)
def test_host_outlives_a_killed_agent_only_to_release_the_memory(tmp_path: Path) -> None:
    """The detached host notices the SIGKILLed agent's connection is gone and unlinks every segment, and
    the files the agent handed it (its workers' beacons), after the idle limit."""
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    beacon = shm_root / "phalanx-j-n-0.beacon"
    beacon.write_bytes(bytes(32))
    agent, host = _start_agent(shm_root, f"killed-{os.getpid()}", beacon)
    try:
        with contextlib.closing(protocol.HostClient(host["socket"])) as client:
            assert client.call({"op": "alloc", "rank": 0, "size": 4096})["ok"]
        assert len(_node_files(shm_root)) == 3  # two slots and the beacon
    finally:
        _kill_agent(agent)
    _wait_gone(host["pid"], checkpointing.IDLE_EXIT_S + 10, "the orphaned host exiting")
    assert not _node_files(shm_root), _node_files(shm_root)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_agent_restarted_within_the_idle_limit_keeps_the_snapshot_in_memory(tmp_path: Path) -> None:
    """An agent SIGKILLed and restarted on the node before its old host's idle limit: the new host takes
    the job's memory over, and the old one exits without unlinking the snapshot, the new socket or the
    beacons, so the restarted workers load from memory; the new host releases everything when it stops."""
    from phalanx.checkpoint import Checkpointer

    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    beacon = shm_root / "phalanx-j-n-0.beacon"
    beacon.write_bytes(bytes(32))
    job = f"restarted-{os.getpid()}"
    first, old = _start_agent(shm_root, job, beacon)
    try:
        ckpt = Checkpointer(job_id=old["job"], host_socket=old["socket"], shm_dir=str(shm_root), rank=0)
        ckpt.save(7, {"w": torch.arange(1000, dtype=torch.float32), "epoch": 2})
        ckpt.close()
    finally:
        _kill_agent(first)
    second, new = _start_agent(shm_root, job, beacon)
    try:
        assert new["pid"] != old["pid"]
        assert new["socket"] == old["socket"]
        # Without the handover the old host exits only at its idle limit and unlinks everything then.
        _wait_gone(old["pid"], checkpointing.IDLE_EXIT_S + 10, "the old host exiting")
        assert beacon.exists()
        assert Path(new["socket"]).exists()
        ckpt = Checkpointer(job_id=new["job"], host_socket=new["socket"], shm_dir=str(shm_root), rank=0)
        loaded = ckpt.load()
        assert loaded is not None
        assert loaded[0] == 7
        assert ckpt.last_load.get("source") == "memory", ckpt.last_load
        assert torch.equal(loaded[1]["w"], torch.arange(1000, dtype=torch.float32))
        ckpt.close()
        with contextlib.closing(protocol.HostClient(new["socket"])) as client:
            assert client.call({"op": "stop"})["ok"]
        _wait_gone(new["pid"], 30, "the new host stopping")
        assert not _node_files(shm_root), _node_files(shm_root)
    finally:
        _kill_agent(second)
