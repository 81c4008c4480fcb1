"""`phalanx-run` with an unmodified torchrun DDP script: standalone (1 node) and two agents against one
master (through `phalanx local`), with warm spares on (the default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.helpers import DDP, phalanx_local

pytestmark = [pytest.mark.integration, pytest.mark.timeout(100)]


def test_ddp_script_standalone(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.cli.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--tee",
            "3",
            "--log-dir",
            str(tmp_path / "logs"),
            str(DDP),
            "--steps",
            "12",
            "--ckpt",
            str(tmp_path / "ck.pt"),
            "--step-log",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        cwd=tmp_path,
        env={**os.environ},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[rank0]:world size 2, starting at step 0" in proc.stdout
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(12))
    # Per-rank log files under --log-dir.
    assert "world size 2" in (tmp_path / "logs" / "round1" / "0" / "stdout.log").read_text()
    assert (tmp_path / "logs" / "round1" / "1" / "stdout.log").exists()


def test_ddp_two_agents_one_master(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    summary = tmp_path / "summary.json"
    proc = phalanx_local(
        [
            "--nodes",
            "2",
            "--nproc-per-node",
            "1",
            "--heartbeat-timeout",
            "3s",
            "--workdir",
            str(tmp_path / "wd"),
            "--summary-json",
            str(summary),
            "--",
            str(DDP),
            "--steps",
            "12",
            "--ckpt",
            str(tmp_path / "ck.pt"),
            "--step-log",
            str(log),
        ],
        cwd=tmp_path,
        timeout=90,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(12))
    assert {e["world_size"] for e in entries} == {2}
    s = json.loads(summary.read_text())
    assert s["exit"] == "succeeded"
    assert s["steps_completed"] == 12
