"""An unmodified DDP script (tests/local/plain_ddp.py: it never imports phalanx) under `phalanx local` with
default settings gets what a script that calls phalanx gets, from phalanx-run's instrumentation
(phalanx.instrument): its steps reach the launcher and the master; a SIGSTOPped rank is caught once it has
been stopped for `hang.stopped_s` (2 s), then a rank that never enters an all-reduce within max(10 s, 3 x p99
step) (its peer's flight recorder shows the all-reduce it waits in); the failure names the collective the peer
waits in and the suspect; training resumes. `--no-instrument` turns all of it off."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.instrument import collective_hooks
from tests.agent.helpers import STANDS_FOR_ANY_HANG, phalanx_local, steps
from tests.eventually import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SCRIPT = Path(__file__).with_name("plain_ddp.py")
TIMEOUT_S = 10.0  # max(10 s, 3 x p99 step) with 0.1 s steps: the default floor
STOPPED_S = 2.0  # hang.stopped_s: a process stopped by a signal


@pytest.mark.skipif(not collective_hooks(), reason="this torch has no c10d collective hooks: the test below")
def test_an_unmodified_script_is_caught_hung_and_blamed_like_an_instrumented_one(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    d = tmp_path / "d"
    proc = phalanx_local(
        [
            "--heartbeat-timeout", "2s", "--agent-arg=--grace-period=1s",
            "--workdir", str(tmp_path / "wd"), "--summary-json", str(summary),
            "--nodes", "2", "--nproc-per-node", "1",
            # step= is the optimizer's step: the script reports none itself
            "--inject", "hang-worker@step=10,node=1,rank=0",
            "--", str(SCRIPT), "--dir", str(d), "--steps", "45", "--step-time", "0.1",
            "--stall-at", "30", "--stall-node", "node-0",
        ],
        cwd=tmp_path,
        timeout=140,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert summary.exists(), out
    s = json.loads(summary.read_text())
    assert proc.returncode == 0, out
    assert s["exit"] == "succeeded", s
    assert s["steps_completed"] >= 10, s  # the launcher saw the optimizer's steps

    (f,) = s["failures"]
    assert f["kind"] == "hang-worker"
    assert f["detected_at"] is not None, out
    assert STOPPED_S - 0.5 < f["detected_at"] - f["injected_at"] < STOPPED_S + 4, f
    assert f["recovered_at"] is not None
    assert re.search(r"rank \d hung after step \d+, stopped by a signal \(host side", out), out

    failures = [line for line in out.splitlines() if re.search(r"event failure\b", line)]
    suspect = re.compile(
        r"suspects: rank\(s\) (\d+) never entered all_reduce #\d+ of pg:0,1; .* on (node-\d)"
    )
    nodes = [node for _, node in (m.groups() for m in map(suspect.search, failures) if m)]
    assert nodes, failures
    assert nodes[-1] == "node-0", failures  # the rank that slept before the all-reduce its peer waits in
    blamed = re.findall(r"event hang_analysis .*counted against (node-\d)", out)
    assert blamed[0] == "node-1", out
    assert blamed[-1] == "node-0", out
    assert max(e["step"] for e in steps(d)) == 44  # training resumed after both hangs


IDLE_FLOOR_S = 20.0  # --hang-idle-floor, 60 s by default: what judges a rank with no collective open


@pytest.mark.skipif(collective_hooks(), reason="this torch's collectives are recorded: the test above")
def test_without_collective_hooks_a_stopped_rank_is_caught_at_the_idle_floor(tmp_path: Path) -> None:
    """torch 2.9 to 2.13 (the train extra's range below 2.14): the steps come from the optimizer as on any
    torch, the collectives are not recorded, and the worker says so; a SIGSTOPped rank is caught at the hang
    idle floor (the stopped verdict held off: the SIGSTOP stands for any rank that stops outside a collective)
    and training resumes."""
    summary = tmp_path / "summary.json"
    d = tmp_path / "d"
    proc = phalanx_local(
        [
            "--heartbeat-timeout", "2s", "--agent-arg=--grace-period=1s",
            f"--agent-arg=--hang-idle-floor={IDLE_FLOOR_S:g}s",
            STANDS_FOR_ANY_HANG,  # the SIGSTOP stands for a rank idle outside any collective
            "--workdir", str(tmp_path / "wd"), "--summary-json", str(summary),
            "--nodes", "2", "--nproc-per-node", "1",
            "--inject", "hang-worker@step=10,node=1,rank=0",
            "--", str(SCRIPT), "--dir", str(d), "--steps", "30", "--step-time", "0.1",
        ],
        cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    s = json.loads(summary.read_text())
    assert s["steps_completed"] >= 10, s
    worker_logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "wd").rglob("*.log"))
    assert "has no c10d collective hooks" in worker_logs, out
    (f,) = s["failures"]
    assert f["kind"] == "hang-worker"
    assert f["detected_at"] is not None, out
    assert IDLE_FLOOR_S - 0.5 < f["detected_at"] - f["injected_at"] < IDLE_FLOOR_S + 8, f
    assert max(e["step"] for e in steps(d)) == 29


def test_no_instrument_leaves_an_unmodified_script_unseen(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    proc = phalanx_local(
        [
            "--workdir", str(tmp_path / "wd"), "--summary-json", str(summary),
            "--nodes", "1", "--nproc-per-node", "1", "--agent-arg=--no-instrument",
            "--", str(SCRIPT), "--dir", str(tmp_path / "d"), "--steps", "20", "--step-time", "0.01",
        ],
        cwd=tmp_path,
        timeout=100,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert json.loads(summary.read_text())["steps_completed"] == 0, out


def test_a_time_based_fault_fires_on_a_script_that_reports_nothing(tmp_path: Path) -> None:
    """Without instrumentation the script reports no step at all; the worker's pid is known from its start, so
    an `after=` fault fires on time (or, due before the worker runs, as soon as it does) and the job
    recovers."""
    summary = tmp_path / "summary.json"
    proc = phalanx_local(
        [
            "--workdir", str(tmp_path / "wd"), "--summary-json", str(summary),
            "--nodes", "1", "--nproc-per-node", "2", "--agent-arg=--no-instrument",
            "--inject", "kill-worker@after=6s,rank=1",
            "--", str(SCRIPT), "--dir", str(tmp_path / "d"), "--steps", "120", "--step-time", "0.1",
        ],
        cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    s = json.loads(summary.read_text())
    (f,) = s["failures"]
    assert f["kind"] == "kill-worker", s
    first_step = min(e["time"] for e in steps(tmp_path / "d"))
    injected = s["started_unix"] + f["injected_at"]
    assert f["injected_at"] >= 6.0, f
    assert injected < max(s["started_unix"] + 6.0, first_step) + 2.0, (f, first_step - s["started_unix"])
    # With no steps reported the launcher cannot time the recovery; the script's own log shows it.
    assert s["rounds"] >= 2, s
    assert max(e["step"] for e in steps(tmp_path / "d")) == 119
    assert s["not_injected"] == [], s


def test_a_fault_that_never_fires_fails_the_run(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    spec = "kill-worker@step=100000"
    proc = phalanx_local(
        [
            "--workdir", str(tmp_path / "wd"), "--summary-json", str(summary),
            "--nodes", "1", "--nproc-per-node", "1", "--inject", spec,
            "--", str(SCRIPT), "--dir", str(tmp_path / "d"), "--steps", "5", "--step-time", "0.01",
        ],
        cwd=tmp_path,
        timeout=100,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    s = json.loads(summary.read_text())
    assert s["not_injected"] == [spec], s
    assert s["exit"] == "failed", s
    assert f"NOT INJECTED: {spec}" in out, out


def test_phalanx_status_shows_the_steps_and_step_times_of_an_unmodified_script(tmp_path: Path) -> None:
    workdir = tmp_path / "wd"
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "local", "--nodes", "2", "--nproc-per-node", "1",
         "--job-id", "plain-status", "--workdir", str(workdir), "--timeout", "120s", "--",
         str(SCRIPT), "--dir", str(tmp_path / "d"), "--steps", "100000", "--step-time", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # "job ...: master at ... (http HOST:PORT); ..."
        found = re.search(r"\(http ([0-9.:]+)\)", first)
        assert found, first
        url = f"http://{found[1]}"

        def scored() -> dict[str, Any] | None:
            status = subprocess.run(
                [sys.executable, "-m", "phalanx", "status", "--master", url,
                 "--token-file", str(workdir / "token"), "-o", "json"],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            if status.returncode != 0:
                return None
            view: dict[str, Any] = json.loads(status.stdout)
            nodes = view["nodes"]
            ok = len(nodes) == 2 and all((n["step"] or 0) >= 20 and n["step_time_s"] for n in nodes)
            return view if ok else None

        view = eventually(scored, timeout=90, what="both nodes' steps and step times in phalanx status")
        for node in view["nodes"]:
            assert node["step_time_s"] > 0.04, node  # the script's 0.05 s steps, as measured
            assert node["straggler_score"] is not None, node
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
