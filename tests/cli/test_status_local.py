"""``phalanx status`` and ``phalanx timeline`` on a live ``phalanx local`` job: a real master, real agents
(phalanx-run) and real worker processes (tests/agent/workload.py, torch-free, real beacons)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.cli.main import main
from tests.agent.helpers import WORKLOAD
from tests.cli.trace_format import check_trace
from tests.eventually import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _status(capsys: pytest.CaptureFixture[str], url: str, token: Path) -> dict[str, Any] | None:
    """``phalanx status -o json``, in this process (polled: no interpreter start per look)."""
    capsys.readouterr()
    code = main(["status", "--master", url, "--token-file", str(token), "-o", "json"])
    out = capsys.readouterr().out
    return json.loads(out) if code == 0 else None


def test_status_and_timeline_of_a_live_local_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workdir = tmp_path / "wd"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "local", "--nodes", "2", "--nproc-per-node", "1",
         "--job-id", "status-live", "--workdir", str(workdir), "--timeout", "80s",
         "--agent-arg=--no-warm-spares", "--",
         str(WORKLOAD), "--dir", str(tmp_path / "d"), "--steps", "2000", "--step-time", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        stdout = proc.stdout
        assert stdout is not None

        def master_address() -> str:
            found = re.search(r"\(http ([0-9.:]+)\)", stdout.readline())  # blocks for the next line
            return f"http://{found[1]}" if found else ""

        url = eventually(
            master_address, timeout=30, what="phalanx local printing its master address", interval=0
        )
        token = workdir / "token"

        def both_training() -> dict[str, Any] | None:
            view = _status(capsys, url, token)
            nodes = view["nodes"] if view else []
            steps = [n["step"] for n in nodes if n["step"] is not None]
            running = view and view["job"]["phase"] == "Running" and len(steps) == 2 and min(steps) >= 3
            return view if running else None

        view = eventually(both_training, timeout=40, what="both nodes training past step 3", interval=0.5)
        assert view is not None
        assert view["job"]["name"] == "status-live"
        assert view["job"]["phase"] == "Running"
        assert view["job"]["world_size"] == 2
        assert [n["node"] for n in view["nodes"]] == ["node-0", "node-1"]
        assert all(n["state"] == "running" and n["member"] for n in view["nodes"])
        assert all(n["heartbeat_age_s"] < 10 for n in view["nodes"])
        assert view["rounds"][0]["round"] == 1
        # The table, as a person runs it.
        table = subprocess.run(
            [sys.executable, "-m", "phalanx", "status", "--master", url, "--token-file", str(token)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert table.returncode == 0, table.stderr
        assert table.stdout.startswith("job status-live: Running  round 1  world 2")
        # The timeline of the last seconds: a valid trace whatever the ranks recorded.
        out = tmp_path / "live"
        capsys.readouterr()
        code = main(["timeline", "--master", url, "--token-file", str(token), "--window", "30", "--no-png",
                     "-o", str(out)])  # fmt: skip
        assert code == 0, capsys.readouterr().err
        trace = json.loads(out.with_suffix(".json").read_text())
        assert check_trace(trace) == []
    finally:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: the agents get SIGTERM and stop their workers
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
