"""Several gloo ranks: sharded state, agreement on the newest common step, replica reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.api.ports import free_port
from phalanx.checkpoint import host as host_mod
from tests import torch_forks
from tests.checkpoint.conftest import worker_env

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


def run_ranks(handle: host_mod.HostHandle, world: int, *args: str) -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = worker_env(
            handle,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmd = [sys.executable, str(HERE / "dist_worker.py"), *args]
        procs.append(torch_forks.popen(cmd, env=env, stdout=subprocess.PIPE, cwd=HERE.parents[1]))
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode == 0, out
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:  # a rank that failed leaves its peers waiting for it
        for proc in procs:
            proc.kill()
            proc.communicate()  # reaps it and closes its pipe
    return sorted(results, key=lambda r: int(r["rank"]))


def test_sharded_save_agree_and_replica_reads(host: host_mod.HostHandle, store: Path, tmp_path: Path) -> None:
    saved = run_ranks(host, 2, "save", f"--storage={store}")
    # rank 1 holds step 3 in memory, rank 0 does not: both load step 2, from memory, each its own shard
    assert [r["step"] for r in saved] == [2, 2]
    assert [r["source"] for r in saved] == ["memory", "memory"]
    assert all(r["ok"] for r in saved)

    empty = tmp_path / "new-node-shm"
    empty.mkdir()
    plain = run_ranks(host, 4, "load", f"--storage={store}", f"--shm-dir={empty}")
    assert all(r["ok"] and r["step"] == 2 for r in plain)
    assert sum(r["reads"] for r in plain) == 8  # every replica read its shard (manifest + tensors)

    shared = run_ranks(host, 4, "load", f"--storage={store}", f"--shm-dir={empty}", "--replicas")
    assert all(r["ok"] and r["step"] == 2 for r in shared)
    assert [r["reads"] for r in shared] == [2, 2, 0, 0]  # one reader per replica group
    assert [r["source"] for r in shared] == ["storage", "storage", "peer", "peer"]


def test_data_parallel_replicas_load_from_memory_when_ranks_move(
    host: host_mod.HostHandle, store: Path
) -> None:
    """Two DDP ranks saved the same state; the next round has three ranks on this node, and rank 2 has no
    snapshot under its own rank. Without ``replicated`` nothing is common to all ranks and, with nothing
    persisted, the job would start over; with it every rank loads the newest step from memory."""
    run_ranks(host, 2, "save-ddp", f"--storage={store}")
    plain = run_ranks(host, 3, "load-ddp", f"--storage={store}")
    assert [r["step"] for r in plain] == [None, None, None]
    shared = run_ranks(host, 3, "load-ddp", f"--storage={store}", "--replicated")
    assert [(r["step"], r["source"], r["reads"], r["ok"]) for r in shared] == [(3, "memory", 0, True)] * 3


def test_a_replacement_node_gets_the_data_parallel_state_from_a_survivor_s_memory(
    host: host_mod.HostHandle, store: Path, tmp_path: Path
) -> None:
    """A node was lost and its replacement's memory is empty; nothing was persisted. Its rank loads the
    newest step from a survivor, instead of the whole job starting over: the lowest rank holding it reads
    it from its memory and hands it to the others."""
    run_ranks(host, 2, "save-ddp", f"--storage={store}")
    empty = tmp_path / "replacement-node-shm"
    empty.mkdir()
    plain = run_ranks(host, 3, "load-ddp", f"--storage={store}", f"--newcomer-shm-dir={empty}")
    assert [r["step"] for r in plain] == [None, None, None]
    shared = run_ranks(
        host, 3, "load-ddp", f"--storage={store}", f"--newcomer-shm-dir={empty}", "--replicated"
    )
    assert [(r["step"], r["source"], r["reads"], r["ok"]) for r in shared] == [
        (3, "memory", 0, True),
        (3, "peer", 0, True),
        (3, "peer", 0, True),
    ]


def test_a_newcomer_sees_the_step_a_peer_committed_before_its_workers_started(
    host: host_mod.HostHandle, store: Path, tmp_path: Path
) -> None:
    """Ranks list storage only once all of them are loading: a newcomer that got there first still finds
    the step the other node committed before starting its workers (its save at breakpoint), instead of
    agreeing with it on an older one."""
    run_ranks(host, 2, "save-late", f"--storage={store}")
    empty = tmp_path / "new-node-shm"
    empty.mkdir()
    loaded = run_ranks(host, 2, "load-late", f"--storage={store}", f"--shm-dir={empty}")
    assert [(r["step"], r["source"], r["ok"]) for r in loaded] == [(4, "storage", True), (4, "memory", True)]


def test_a_malformed_manifest_fails_every_rank_at_once(
    host: host_mod.HostHandle, store: Path, tmp_path: Path
) -> None:
    """Only rank 1's manifest of step 2 is malformed: both ranks skip step 2 and load step 1, instead of
    rank 1 raising while rank 0 waits in the vote. With step 1 broken too, differently on each rank (a
    skeleton that does not decode, truncated JSON), nothing is left: every rank raises the same
    CheckpointCorruptError, promptly (see dist_worker.corrupt_loads)."""
    empty = tmp_path / "new-node-shm"
    empty.mkdir()
    ranks = run_ranks(host, 2, "corrupt-loads", f"--storage={store}", f"--shm-dir={empty}")
    assert [(r["first"].get("step"), r["first"].get("ok")) for r in ranks] == [(1, True)] * 2, ranks
    second = [r["second"] for r in ranks]
    assert [r.get("error") for r in second] == ["CheckpointCorruptError"] * 2, second
    assert second[0]["message"] == second[1]["message"]
    assert "steps [1, 2]" in second[0]["message"]
    assert all(r["seconds"] < 20 for r in second), second
