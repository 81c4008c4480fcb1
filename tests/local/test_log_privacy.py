"""``phalanx local`` keeps the job's logs, state and token owner-only: 0600 files in 0700 directories,
whatever the umask (a real run of one node with a worker that prints and exits)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_job_logs_state_and_token_are_owner_only(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    # The pause lets the agent ship the line (once a heartbeat interval) before the job ends.
    script.write_text('import time\nprint("hello from the worker", flush=True)\ntime.sleep(1.5)\n')
    work = tmp_path / "work"
    argv = [
        sys.executable, "-m", "phalanx", "local", "--nodes", "1", "--nproc-per-node", "1",
        "--workdir", str(work), "--agent-arg=--no-warm-spares", "--agent-arg=--no-checkpoint-host",
        "--", str(script),
    ]  # fmt: skip
    old = os.umask(0o022)  # the usual umask: files 0644, directories 0755 unless made private
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=50, check=False)
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert mode(work) == 0o700
    assert mode(work / "node-0") == 0o700  # the agent's log dir, with the workers' logs inside
    logs = ["master.log", "node-0.log", "master-state.log", "master-state.json", "token"]
    assert {name: oct(mode(work / name)) for name in logs} == {name: oct(0o600) for name in logs}
    assert "hello from the worker" in (work / "master-state.log").read_text()  # the master's job log
