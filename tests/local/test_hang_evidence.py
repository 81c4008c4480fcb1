"""`phalanx local` with default hang settings and a real gloo DDP job whose interval recorder is on
(tests/local/hang_ddp.py): a SIGSTOPped rank, then a rank that never enters an all-reduce, are each caught
within max(10 s, 3 x p99 step); the failure names the collective the peers wait in and the suspect node, the
hang is counted against the suspect, and training resumes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.agent.helpers import STANDS_FOR_ANY_HANG, phalanx_local, steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SCRIPT = Path(__file__).with_name("hang_ddp.py")
TIMEOUT_S = 10.0  # max(10 s, 3 x p99 step) with 0.1 s steps: the default floor


def test_sigstop_and_never_entered_collective_blame_the_suspect_node(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    d = tmp_path / "d"
    proc = phalanx_local(
        [
            "--heartbeat-timeout", "2s", "--agent-arg=--grace-period=1s",
            "--workdir", str(tmp_path / "wd"), "--summary-json", str(summary),
            "--nodes", "2", "--nproc-per-node", "1",
            "--inject", "hang-worker@step=10,node=1,rank=0",
            STANDS_FOR_ANY_HANG,
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

    # The SIGSTOP: caught after the timeout, not the old 60 s.
    (f,) = s["failures"]
    assert f["kind"] == "hang-worker"
    assert f["node"] == "node-1"
    assert f["detected_at"] is not None, out
    assert TIMEOUT_S - 0.5 < f["detected_at"] - f["injected_at"] < TIMEOUT_S + 4, f
    assert f["recovered_at"] is not None

    failures = [line for line in out.splitlines() if re.search(r"event failure\b", line)]
    suspect = re.compile(
        r"suspects: rank\(s\) (\d+) never entered all_reduce #\d+ of dp:0,1; .* on (node-\d)"
    )
    found = [m.groups() for m in map(suspect.search, failures) if m]
    # Node-0's rank slept before an all-reduce its peer waits in: the recorder names it as the suspect.
    # (Global ranks follow the join order, so only the nodes are fixed.)
    nodes = [node for _, node in found]
    assert nodes, failures
    assert nodes[-1] == "node-0", failures
    # The stopped rank (node-1) never entered the all-reduce its peer waits in, and the recorder names it
    # too; unless the stop came after it had entered, when both ranks wait in it and the stopped process
    # in the stacks singles it out. Either way each hang counts against its culprit, whichever node
    # reported first.
    blamed = re.findall(r"event hang_analysis .*counted against (node-\d)", out)
    assert blamed[0] == "node-1", out
    assert blamed[-1] == "node-0", out
    assert re.search(
        r"rank \d hung (in all_reduce #\d+ of dp:0,1|after step \d+, in no collective) \(host side", out
    ), out

    wd = (tmp_path / "wd" / "node-0.log").read_text() + (tmp_path / "wd" / "node-1.log").read_text()
    assert re.search(r"rank \d stalls before the all-reduce of step 30", out + wd)  # ranks follow join order
    # The waiting rank's recorder answered with gloo's flight recorder: the all-reduce it waits in was queued
    # and never completed.
    recorded = re.findall(r"flight recorder: \d+ entries; pg 0 enqueued #(\d+), completed #(\d+)", wd)
    assert recorded, wd
    assert all(int(enqueued) == int(completed) + 1 for enqueued, completed in recorded), recorded
    assert max(e["step"] for e in steps(d)) == 44  # training resumed after both hangs
