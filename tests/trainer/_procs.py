"""Starting real worker processes for the trainer tests (forked from the lane's torch zygote,
tests/torch_forks.py; JSON in and out, no pickle)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from phalanx.api.ports import free_port
from tests import torch_forks

ROOT = Path(__file__).resolve().parents[2]


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env["OMP_NUM_THREADS"] = "1"  # 2 cores shared by many processes: threads would only fight
    env.update(extra)
    return env


def run_world(script: Path, *, world: int, args: list[str], timeout_s: float) -> list[dict[str, object]]:
    """Runs ``script`` as ``world`` ranks (torchrun-style env) and returns each rank's last JSON line."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = worker_env(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            torch_forks.popen(
                [sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        )
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err[-4000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()  # reaps it and closes its pipes: a failed rank leaves no open file behind
    return results
