"""A ``phalanx local`` that is SIGKILLed (``kill -9``, the OOM killer) takes its job with it: the master and
the agents watch the process that started them and leave once it is gone, the agents as on SIGTERM, so the
workers and the checkpoint hosts go too. Before, the whole job trained on unwatched, holding its ports and
its memory (a test's launcher, killed when it did not stop in time, left its master running after the
suite)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.helpers import WORKLOAD, steps
from tests.eventually import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

JOB = "launcher-killed"


def _processes_of(tmp: Path) -> dict[int, bytes]:
    """Every process whose command line names ``tmp`` (the job's files are there), with that command line:
    the checkpoint hosts detach from their agents, so a walk of the launcher's tree would miss them."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ") if entry.name.isdigit() else b""
        except OSError:
            continue
        if str(tmp).encode() in cmdline and int(entry.name) != os.getpid():
            out[int(entry.name)] = cmdline
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_a_sigkilled_phalanx_local_leaves_no_process_of_its_job(tmp_path: Path) -> None:
    work = tmp_path / "d"
    tree: list[int] = []
    launcher = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "local", "--nodes", "2", "--nproc-per-node", "1", "--job-id", JOB,
         "--workdir", str(tmp_path / "wd"), "--timeout", "80s", "--agent-arg=--no-warm-spares",
         "--", str(WORKLOAD), "--dir", str(work), "--steps", "2000", "--step-time", "0.05"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        eventually(lambda: {e["rank"] for e in steps(work)} == {0, 1}, timeout=60, what="both ranks training")
        job = _processes_of(tmp_path)
        tree += job
        commands = list(job.values())
        assert any(b"phalanx master" in c for c in commands), commands
        assert sum(b"phalanx.cli.run" in c for c in commands) == 2, commands
        assert sum(str(WORKLOAD).encode() in c for c in commands) >= 2, commands  # a worker per node
        assert sum(b"phalanx.checkpoint.host" in c for c in commands) == 2, "\n".join(map(repr, commands))
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        # The master and the agents poll their parent every 0.5 s; the agents then stop their workers.
        eventually(
            lambda: not [p for p in tree if _alive(p)], timeout=30, what="every process of the job exiting"
        )
    finally:
        launcher.kill()
        launcher.wait()
        for pid in tree:  # only where the test failed: nothing is left otherwise
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
