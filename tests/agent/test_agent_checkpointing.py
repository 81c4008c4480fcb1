"""The agent's checkpoint-host lifecycle and probe handling: pure decisions, configuration, and the
real host and probe processes driven through the agent's own code paths."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from phalanx.agent import checkpointing, probes
from phalanx.agent import config as agent_config
from phalanx.agent.client import MasterClient
from phalanx.api.errors import ConfigError
from phalanx.api.v1 import master_pb2 as pb
from phalanx.checkpoint import protocol, shm

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


# ------------------------------------------------------------------------------------------------------
# The real host, through the agent's lifecycle object


def test_host_that_cannot_start_is_logged_and_skipped(tmp_path: Path) -> None:
    said: list[str] = []
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the shared-memory root is a file: the node's directory cannot be made
    host = checkpointing.NodeCheckpointHost(said.append)
    started = host.start(
        settings=agent_config.CheckpointSettings(),
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
    host = checkpointing.NodeCheckpointHost(said.append)
    storage = tmp_path / "ckpt"
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    assert host.start(
        settings=agent_config.CheckpointSettings(storage_path=str(storage)),
        shm_root=shm_root,
        job_id=job,
        node_id="node/0",
        master_addr="",
        token_file="",
        incarnation="i",
    )
    try:
        env = host.env()
        assert env[protocol.ENV_JOB] == f"{job}.node_0"  # per node: agents of one job may share a machine
        assert env[protocol.ENV_STORAGE] == str(storage)
        client = protocol.HostClient(env[protocol.ENV_SOCKET])
        # Two ranks' slots, written the way a Checkpointer writes them (header + raw bytes), torch-free.
        for rank, steps in ((0, (6, 7)), (1, (7, 8))):
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
        client.close()
        assert checkpointing.held_steps(shm_root, job_id=env[protocol.ENV_JOB], ranks=[0, 1]) == {
            0: {6, 7},
            1: {7, 8},
        }
        # The node's workers are global ranks 4 and 5, but the slots are named 0 and 1 (as the trainer
        # names them, by model shard): the snapshots on the node are persisted all the same.
        result = host.save_at_breakpoint("test", ranks=[4, 5])
        assert result == {"ok": True, "step": 7, "errors": []}, said
        from phalanx.checkpoint import storage as storage_lib

        assert storage_lib.committed_steps(storage_lib.open_storage(str(storage))) == [7]
        assert len(list(shm_root.iterdir())) == 4
    finally:
        started = time.monotonic()
        host.stop()
    assert time.monotonic() - started < 5
    assert not any(shm_root.iterdir())
    assert not Path(env[protocol.ENV_SOCKET]).exists()


# ------------------------------------------------------------------------------------------------------
# Probes: the agent's handling path against a real master and the real matmul probe


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_run_probe_action_reports_matmul_measurements(tmp_path: Path) -> None:
    job = f"probe-{os.getpid()}"
    token = tmp_path / "token"
    token.write_text("probe-token-" + "x" * 16)
    master = subprocess.Popen(
        [
            sys.executable, "-m", "phalanx", "master", "--job-id", job, "--nodes", "1:1", "--port", "0",
            "--http-port", "0", "--token-file", str(token), "--state", str(tmp_path / "state.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    assert master.stdout is not None
    client = None
    try:
        values = dict(master.stdout.readline().strip().split("=", 1) for _ in range(2))
        client = MasterClient(address=values["PHALANX_MASTER_GRPC"], token=token.read_text())
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
        assert executor.start(action) is None  # one probe at a time
        executor.join(50)
        assert not thread.is_alive()
        report = executor.last_report
        assert report is not None
        assert report.probe_round == 3
        assert [m.ok for m in report.measurements] == [True] * len(report.measurements), said
        assert all(m.rate > 0 for m in report.measurements)
        req = urllib.request.Request(
            f"http://{values['PHALANX_MASTER_HTTP']}/v1/nodes",
            headers={"Authorization": f"Bearer {token.read_text()}"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            nodes = json.loads(resp.read())["nodes"]
        matmul = nodes[0]["probes"]["matmul"]
        assert matmul
        assert all(m["ok"] and m["rate"] > 0 and m["probe_round"] == 3 for m in matmul)
    finally:
        if client is not None:
            client.close()
        master.terminate()
        master.wait(10)
        master.stdout.close()


@pytest.mark.integration
@pytest.mark.timeout(40)
def test_host_outlives_a_killed_agent_only_to_release_the_memory(tmp_path: Path) -> None:
    """SIGKILL to the agent's whole process group (a node kill in ``phalanx local``): the detached host
    notices the agent's connection is gone and unlinks every segment, and the files the agent handed it
    (its workers' beacons), after the idle limit."""
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    beacon = shm_root / "phalanx-j-n-0.beacon"
    beacon.write_bytes(bytes(32))
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from phalanx.agent import checkpointing as c\n"
            "from phalanx.api.settings import CheckpointSettings\n"
            "from phalanx.checkpoint import protocol\n"
            "h = c.NodeCheckpointHost(print)\n"
            "assert h.start(settings=CheckpointSettings(), shm_root=Path(sys.argv[1]), job_id=sys.argv[2],"
            " node_id='n', master_addr='', token_file='', incarnation='i',"
            " release_also=[Path(sys.argv[3])])\n"
            "cl = protocol.HostClient(h.env()[protocol.ENV_SOCKET])\n"
            "print(cl.call({'op': 'alloc', 'rank': 0, 'size': 4096}), flush=True)\n"
            "cl.close()\n"
            "time.sleep(60)\n",
            str(shm_root),
            f"killed-{os.getpid()}",
            str(beacon),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert agent.stdout is not None
    try:
        lines = [agent.stdout.readline() for _ in range(2)]
        assert "paths" in lines[1], lines
        assert len(list(shm_root.iterdir())) == 3  # two slots and the beacon
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        agent.stdout.close()
    deadline = time.monotonic() + checkpointing.IDLE_EXIT_S + 10
    while any(shm_root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(shm_root.iterdir()), list(shm_root.iterdir())
