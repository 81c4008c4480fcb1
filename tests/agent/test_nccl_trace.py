"""A hung rank's flight recorder in its hang evidence: the agent asks through the interval ring, the
worker's watcher thread answers with torch's own JSON dump. The handshake is checked with two real threads
on a real ring; gloo's dump with a real two-rank job on the CPU, one rank blocked in an all-reduce its peer
never enters; NCCL's on a GPU only (a real one-rank NCCL job), skipped without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.agent import env as worker_env
from phalanx.api import intervals as ring
from phalanx.api.ports import free_port as _free_port
from phalanx.diagnostics import hang

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ring_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"phalanx-test-nccl-ring-{os.getpid()}"
    ring.create(path)
    yield path
    path.unlink(missing_ok=True)


def test_the_agent_asks_for_the_trace_by_default() -> None:
    env = worker_env.static_env({}, local_rank=0, local_world_size=1, job_id="j", node_id="n")
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env, "torch warns of the older name"
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        mine = worker_env.static_env({name: "0"}, local_rank=0, local_world_size=1, job_id="j", node_id="n")
        assert mine[name] == "0", "a job's own setting wins, by either name"
        assert len([k for k in mine if k.endswith("_BUFFER_SIZE")]) == 1


def test_a_rank_blocked_in_a_gloo_all_reduce_answers_with_gloos_flight_recorder(
    ring_path: Path, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 15):
        # 2.11's dump has no entries for gloo; 2.15, the release phalanx pins, records them.
        pytest.skip(f"torch {torch.__version__} keeps no flight recorder of gloo's collectives")
    base = {
        **os.environ,
        "TORCH_FR_BUFFER_SIZE": "2000",  # as the agent sets it
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    ready = tmp_path / "ready"
    other = Path(str(ring_path) + "-1")
    ring.create(other)
    worker = ROOT / "tests" / "agent" / "gloo_trace_worker.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(ready)],
            env={**base, "RANK": str(rank), ring.ENV_VAR: str(path)},
        )
        for rank, path in enumerate((ring_path, other))
    ]
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, "the ranks never got past their first all-reduce"
            time.sleep(0.05)
        # Rank 0 is in (or about to enter) the second all-reduce, which rank 1 never enters.
        deadline = time.monotonic() + 30
        while True:
            text = ring.request_dump(ring_path, timeout_s=5.0)
            summary = hang.flight_recorder_summary(text)
            if "enqueued #2, completed #1" in summary or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
        other.unlink(missing_ok=True)
    dump = json.loads(text)
    assert [(e["collective_seq_id"], e["profiling_name"]) for e in dump["entries"]] == [
        (1, "gloo:all_reduce"),
        (2, "gloo:all_reduce"),
    ], text[:2000]
    assert summary == "flight recorder: 2 entries; pg 0 enqueued #2, completed #1", summary


def test_a_worker_that_offers_no_dumps_costs_the_agent_nothing(ring_path: Path) -> None:
    writer = ring.RingWriter(ring_path)
    try:
        start = time.monotonic()
        assert ring.request_dump(ring_path, timeout_s=5.0) == ""
        assert time.monotonic() - start < 0.5
    finally:
        writer.close()


def test_the_dump_handshake_between_the_agent_and_a_watcher_thread(ring_path: Path) -> None:
    writer = ring.RingWriter(ring_path)
    writer.offer_dumps()
    answered: list[int] = []

    def watcher() -> None:  # what the recorder's CUDA watcher does, with a fixed answer
        deadline = time.monotonic() + 5
        while not answered and time.monotonic() < deadline:
            asked = writer.dump_asked()
            if asked:
                writer.dump_done(asked, b'{"entries": []}' + b" " * 70_000)
                answered.append(asked)
            time.sleep(0.005)

    thread = threading.Thread(target=watcher)
    thread.start()
    try:
        text = ring.request_dump(ring_path, timeout_s=5.0)
    finally:
        thread.join()
        writer.close()
    assert answered == [1]
    assert text.startswith('{"entries": []}')
    assert text.endswith("... (cut)"), "cut to MAX_NCCL_TRACE_BYTES"
    assert not Path(str(ring_path) + ring.DUMP_SUFFIX).exists(), "the dump file is removed once read"
    # Nobody answers a second request now: the agent gives up after its timeout.
    assert ring.request_dump(ring_path, timeout_s=0.2) == ""


@pytest.mark.timeout(120)
def test_a_cuda_worker_answers_with_its_nccl_flight_recorder(ring_path: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("needs a CUDA GPU with NCCL")
    env = {
        **os.environ,
        ring.ENV_VAR: str(ring_path),
        "TORCH_FR_BUFFER_SIZE": "2000",  # as the agent sets it
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    ready, leave = tmp_path / "ready", tmp_path / "leave"
    worker = ROOT / "tests" / "agent" / "nccl_trace_worker.py"
    proc = subprocess.Popen([sys.executable, str(worker), str(ready), str(leave)], env=env)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, f"the worker exited {proc.returncode}"
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.1)
        text = ring.request_dump(ring_path, timeout_s=10.0)
    finally:
        leave.write_text("")
        proc.wait(60)
    assert text, "no answer"
    trace = json.loads(text)
    entries = trace.get("entries", [])
    assert any("all_reduce" in str(e.get("profiling_name", "")) for e in entries), text[:2000]
