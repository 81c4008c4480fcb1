"""Shared helpers for the agent and cluster integration tests."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = Path(__file__).with_name("workload.py")
DDP = ROOT / "examples" / "ddp_mlp.py"


def steps(d: Path) -> list[dict[str, Any]]:
    """Every step line the workload wrote, ordered by time."""
    out = []
    for f in d.glob("steps-*.jsonl"):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["time"])


STANDS_FOR_ANY_HANG = "--agent-arg=--hang-stopped=1h"
"""For a test whose SIGSTOP stands for any hang (a deadlock, a stuck collective): the agent's verdict on a
process stopped by a signal (``hang.stopped_s``, 2 s) would catch it before the detection the test is
about."""


def phalanx_local(args: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "local", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass(frozen=True)
class MasterProc:
    grpc: str
    http: str
    token_file: Path

    @property
    def token(self) -> str:
        return self.token_file.read_text()


@contextlib.contextmanager
def master_process(tmp: Path, job: str, *args: str, nodes: str = "1:1") -> Iterator[MasterProc]:
    """A real ``phalanx master`` for ``job`` (state and token under ``tmp``), stopped on the way out."""
    token = tmp / "token"
    token.write_text("t0k3n-" + "x" * 20)
    token.chmod(0o600)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "phalanx", "master", "--job-id", job, "--nodes", nodes, "--port", "0",
            "--http-port", "0", "--token-file", str(token), "--state", str(tmp / "state.json"), *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        values = dict(proc.stdout.readline().strip().split("=", 1) for _ in range(2))
        yield MasterProc(
            grpc=values["PHALANX_MASTER_GRPC"], http=values["PHALANX_MASTER_HTTP"], token_file=token
        )
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
