"""`phalanx local`, 2 nodes x 1 process of examples/ddp_mlp.py (gloo DDP, no interval recorder: the beacon
alone finds the hang), the same rank SIGSTOPped twice. Both beacons go stale within a step of each other and
the two stacks tie, so either agent may report first; the stopped rank's process state, which its agent reads
in /proc, singles out its node. Each hang counts against node-1, whose second evicts it; node-0, the victim,
is never charged, whichever node reported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.agent.helpers import STANDS_FOR_ANY_HANG, phalanx_local

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ddp_mlp.py"


def test_a_beacon_only_hang_of_two_nodes_counts_against_the_stopped_node_only(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    log = tmp_path / "steps.jsonl"
    proc = phalanx_local(
        [
            "--heartbeat-timeout", "2s", "--agent-arg=--grace-period=1s",
            "--agent-arg=--hang-floor=2s", "--agent-arg=--hang-idle-floor=2s", STANDS_FOR_ANY_HANG,
            "--workdir", str(tmp_path / "wd"), "--summary-json", str(summary),
            # After node-1's eviction node-0 trains on alone: no replacement to wait for.
            "--nodes", "1:2", "--nproc-per-node", "1", "--max-replacements", "0",
            # Both nodes in the first round: with min 1, a round completes a second after node-0 joins
            # unless node-1 registered by then, and a loaded machine once started it 1.6 s later; node-0
            # then trained alone and the injections by step landed elsewhere (no second stop was seen).
            "--master-arg=--last-call=5",
            "--inject", "hang-worker@step=8,node=1,rank=0",
            "--inject", "hang-worker@step=20,node=1,rank=0",
            "--", str(SCRIPT), "--steps", "30", "--step-time", "0.05",
            "--ckpt", str(tmp_path / "ckpt.pt"), "--step-log", str(log),
        ],
        cwd=tmp_path,
        timeout=150,  # about 13 s on a quiet 2-core machine; minutes when it is loaded
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert summary.exists(), out
    s = json.loads(summary.read_text())
    assert proc.returncode == 0, out
    assert s["exit"] == "succeeded", s
    assert [(f["kind"], f["node"]) for f in s["failures"]] == [("hang-worker", "node-1")] * 2, s

    # Who noticed each hang first is up to the timing; the count never goes by it.
    reporters = re.findall(r"event failure\s+(node-\d)\s+rank \d on node-\d \(hang\)", out)
    assert reporters, out
    assert "counted against node-0" not in out, out
    assert not re.search(r"event eviction_requested\s+node-0", out), out
    # node-1 was charged both times: its second hang evicted it.
    assert [e["node_id"] for e in s["evictions"]] == ["node-1"], s
    assert re.search(r"node-1 hung 2 times \(rank\(s\) \d on node-1 stopped", out), out
    last = [json.loads(line) for line in log.read_text().splitlines()][-1]
    assert (last["step"], last["world_size"]) == (29, 1), last  # node-0 trained on alone to the end
