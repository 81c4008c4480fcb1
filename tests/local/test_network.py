"""`phalanx local` with a bad network between a node and the master (a relay that adds latency or cuts
the link, see phalanx.local.relay): a slow link costs nothing, an answer lost in a cut is repeated, and a
node cut off for good is declared lost, evicted and replaced. The workload is tests/agent/workload.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.agent.helpers import WORKLOAD, steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Probe rounds keep one-shot RUN_PROBE actions flowing to every node. A missing probe report evicts a node;
# a slow one must not here (the CPU matmul rates of this machine are noise), so only absence counts.
PROBES = [
    "--master-arg=--probes-enabled=true",
    "--master-arg=--probes-kinds=matmul",
    "--master-arg=--probes-stragglers-compute-threshold=0.01",
    "--master-arg=--probes-timeout-s=20",
]


def _argv(tmp: Path, *args: str, workload: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "phalanx", "local", "--agent-arg=--no-warm-spares",
        "--workdir", str(tmp / "wd"), "--summary-json", str(tmp / "summary.json"), *args,
        "--", str(WORKLOAD), "--dir", str(tmp / "d"), *workload,
    ]  # fmt: skip


def _run(tmp: Path, *args: str, workload: list[str]) -> tuple[int, dict, str]:  # type: ignore[type-arg]
    proc = subprocess.run(
        _argv(tmp, *args, workload=workload),
        cwd=tmp,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert (tmp / "summary.json").exists(), out
    return proc.returncode, json.loads((tmp / "summary.json").read_text()), out


def _probe_results(out: str) -> list[str]:
    return re.findall(r"event probe_finished\s+(\w+):", out)


def test_slow_link_costs_no_restart_and_no_action(tmp_path: Path) -> None:
    # 1.2 s each way from the start: registration, rendezvous, heartbeats and every probe round run over it.
    # A held heartbeat's answer then needs more than the agent's default 2 s beyond the hold. The first probe
    # round starts each node's probe server (import torch) beside four training processes: on a machine
    # starved by the other tests that took over 20 s once (the report came 0.7 s late and evicted node-1), so
    # 45 s for it, and 30 s of training for the rounds after it.
    code, s, out = _run(
        tmp_path,
        "--nodes", "2", "--nproc-per-node", "2", *PROBES, "--master-arg=--probes-interval-s=1",
        "--master-arg=--probes-timeout-s=45",
        "--inject", "delay-node@after=0s,node=1,latency=1200ms",
        workload=["--steps", "300", "--step-time", "0.1"],
    )  # fmt: skip
    assert code == 0, out
    assert s["exit"] == "succeeded"
    assert s["rounds"] == 1, out  # nobody was declared lost, no worker restarted
    assert s["evictions"] == []
    results = _probe_results(out)
    assert results.count("ok") >= 2, out  # each RUN_PROBE reached node-1 and its report came back
    assert set(results) <= {"ok", "aborted"}, out
    # The agent allows its heartbeats more time once it measured the slow link: at most the first is late.
    log = (tmp_path / "wd" / "node-1.log").read_text()
    assert len(re.findall(r"heartbeat failed .*DEADLINE_EXCEEDED", log)) <= 1, log
    assert "Channel closed" not in log  # the agent's own shutdown is no failed heartbeat
    assert max(e["step"] for e in steps(tmp_path / "d")) == 299


def test_action_whose_answer_was_lost_in_a_cut_is_repeated(tmp_path: Path) -> None:
    """The link of node-1 is cut for 6 s while its heartbeat is held at the master; a probe round starts
    at once, so the answer carrying node-1's RUN_PROBE is sent into the cut and arrives after the agent gave
    up on that call. The master repeats the action until a heartbeat acknowledges it: node-1 runs the probe
    after the heal and nobody is evicted (a lost action would be a missing report, so an eviction)."""
    proc = subprocess.Popen(
        _argv(
            tmp_path,
            # A probe starts its server (imports torch) on a node starved by the other tests: 45 s for it.
            "--nodes", "2", "--nproc-per-node", "2", *PROBES, "--master-arg=--probes-timeout-s=45",
            "--inject", "partition-node@step=15,node=1,for=6s",
            workload=["--steps", "450", "--step-time", "0.1"],
        ),
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        http = ""
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"\(http ([\d.:]+)\)", line):
                http = m.group(1)
            if "INJECT partition-node" in line:
                break
        assert http, "".join(lines)
        token = (tmp_path / "wd" / "token").read_text().strip()
        resp = httpx.post(f"http://{http}/v1/probe", headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code == 202, resp.text
        rest = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
        rest.start()
        assert proc.wait(timeout=100) == 0, "".join(lines)
        rest.join(timeout=10)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    out = "".join(lines)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["exit"] == "succeeded"
    assert s["evictions"] == [], out
    assert s["rounds"] == 1, out
    assert _probe_results(out)[0] == "ok", out
    node1 = (tmp_path / "wd" / "node-1.log").read_text()
    assert "heartbeat failed" in node1, node1  # the cut was real: a heartbeat's answer did not come in time
    assert "running the matmul probe (probe round 1)" in node1, node1


def test_node_cut_off_for_good_is_lost_evicted_and_replaced(tmp_path: Path) -> None:
    code, s, out = _run(
        tmp_path,
        "--nodes", "2", "--nproc-per-node", "2", "--heartbeat-timeout", "3s",
        "--inject", "partition-node@step=10,node=1",
        workload=["--steps", "80", "--step-time", "0.1"],
    )  # fmt: skip
    assert code == 0, out
    assert s["exit"] == "succeeded"
    (f,) = s["failures"]
    assert f["kind"] == "partition-node"
    assert f["detected_at"] is not None, out  # silence is all the master saw: no reset, no error
    assert f["recovered_at"] is not None, out
    (ev,) = s["evictions"]
    assert ev["node_id"] == "node-1"
    assert ev["replacement"] == "node-2"
    assert "event node_lost" in out
    lines = steps(tmp_path / "d")
    assert {e["node"] for e in lines if e["round"] == max(x["round"] for x in lines)} == {"node-0", "node-2"}
    assert max(e["step"] for e in lines) == 79
