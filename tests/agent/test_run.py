"""`phalanx-run` with an unmodified torchrun DDP script: standalone (1 node) and two agents against one
master (through `phalanx local`), with warm spares on (the default)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.helpers import DDP, WORKLOAD, phalanx_local
from tests.eventually import eventually

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


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_standalone_master_exits_when_its_agent_is_sigkilled(tmp_path: Path) -> None:
    agent = subprocess.Popen(
        [
            sys.executable, "-m", "phalanx.cli.run", "--standalone", "--nproc-per-node", "1",
            "--no-warm-spares", str(WORKLOAD), "--dir", str(tmp_path), "--steps", "10000",
        ],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def serving_master() -> int:
            """The master's pid once training runs (the master is serving by then), else 0."""
            assert agent.poll() is None, "phalanx-run exited early"
            if not list(tmp_path.glob("steps-*.jsonl")):
                return 0
            master = 0
            for pid in _children(agent.pid):
                with contextlib.suppress(FileNotFoundError):
                    if b"master" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                        master = pid
            return master

        master = eventually(
            serving_master, timeout=60, what="a serving master process under phalanx-run --standalone"
        )
        agent.kill()  # SIGKILL: no cleanup code of the agent runs
        agent.wait()
        eventually(
            lambda: not _alive(master), timeout=10, what="the standalone master exiting after its agent"
        )
    finally:
        agent.kill()
        agent.wait()
