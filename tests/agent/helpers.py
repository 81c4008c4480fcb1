"""Shared helpers for the agent and cluster integration tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
