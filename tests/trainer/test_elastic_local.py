"""The GPT example through the real stack: ``phalanx local`` runs a master and three ``phalanx-run``
agents, a whole node is SIGKILLed mid-training, and the survivors regroup in their own processes through
the agents' regroup mode while the flash checkpoint persists through the agents' checkpoint hosts."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.checkpoint.storage import committed_steps, open_storage
from tests.trainer._procs import ROOT, worker_env
from tests.trainer.test_elastic import TINY, _reference_losses

# Long enough that the replacement node joins while the survivors still train, on a loaded machine too: at 150
# its start-up was once slower than the survivors' remaining 13 s, and it joined after the last step.
STEPS = 250
KILL_AT = 15


def _logs(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """Every worker process's JSON lines, by pid (one file per process: ``--log-json log-{pid}.jsonl``)."""
    return {
        int(f.stem.removeprefix("log-")): [json.loads(line) for line in f.read_text().splitlines()]
        for f in sorted(folder.glob("log-*.jsonl"))
    }


@pytest.mark.integration
@pytest.mark.timeout(180)  # ~35 s on an idle 2-core machine
def test_node_loss_through_phalanx_local_keeps_survivor_processes(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    ckpt = tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "phalanx.cli.main", "local",
        "--nodes", "2:3", "--nproc-per-node", "1", "--heartbeat-timeout", "2s",
        "--inject", f"kill-node@step={KILL_AT},node=2",
        "--summary-json", str(summary_path), "--workdir", str(tmp_path / "work"), "--timeout", "150s",
        f"--agent-arg=--checkpoint-dir={ckpt}",  # the agents own the checkpoint hosts
        "--", str(ROOT / "examples" / "gpt" / "train.py"),
        *TINY, "--steps", str(STEPS), "--global-batch", "12", "--pace-ms", "100", "--digest",
        "--ckpt-every", "10", "--log-json", str(tmp_path / "log-{pid}.jsonl"),
    ]  # fmt: skip
    out = tmp_path / "local.txt"
    with out.open("wb") as f:
        code = subprocess.run(
            cmd, check=False, env=worker_env(), stdout=f, stderr=subprocess.STDOUT, timeout=170
        ).returncode
    assert code == 0, out.read_text()[-4000:]

    summary = json.loads(summary_path.read_text())
    assert summary["exit"] == "succeeded"
    [failure] = summary["failures"]
    assert failure["kind"] == "kill-node"
    assert failure["steps_lost"] == 0
    # The replacement is part of the same fault: folded in at a checkpoint boundary (a trainer that regroups
    # in process saves nothing at breakpoint, so the master waits for the next committed step), or, when it
    # registered early, taken into the survivors' own round.
    fold = failure["fold_in"]
    assert (fold["node"], fold["world"], fold["steps_lost"]) == ("node-3", 3, 0), fold
    if fold["reformed_world"]:
        assert re.fullmatch(
            r"scale up: 1 node\(s\) waiting; at a checkpoint boundary: step \d+0 committed", fold["reason"]
        )

    logs = _logs(tmp_path)
    formed = {pid: [r for r in recs if r["event"] == "formed"] for pid, recs in logs.items()}
    survivors = [pid for pid, f in formed.items() if any(r["cause"] == "failure" for r in f)]
    assert len(survivors) == 2, formed
    for pid in survivors:
        # One process from start to finish: world 3, regrouped in place (to 2 while the replacement starts,
        # unless it registered before the survivors' round completed), then 3 again with the joiner.
        assert {r["pid"] for r in logs[pid] if "pid" in r} == {pid}
        shape = [(r["world"], r["action"]) for r in formed[pid]]
        assert shape in (
            [(3, "continue"), (2, "continue"), (3, "broadcast")],
            [(3, "continue"), (3, "broadcast")],
        ), formed[pid]
        steps = [r["step"] for r in logs[pid] if r["event"] == "step"]
        assert steps == list(range(1, STEPS + 1))  # no step lost or repeated
    [joiner] = [pid for pid, f in formed.items() if f and f[0]["round"] > 1]
    assert formed[joiner][0]["action"] == "broadcast"
    assert len({formed[pid][-1]["digest"] for pid in [*survivors, joiner]}) == 1  # identical state
    # The loss continues across the regroup: it follows the fault-free run (see test_elastic).
    reference = _reference_losses(KILL_AT + 5)
    got = [r["loss"] for r in logs[survivors[0]] if r["event"] == "step"]
    for i in range(KILL_AT + 5):
        assert math.isclose(got[i], reference[i], rel_tol=1e-4), (i + 1, got[i], reference[i])
    # Past that, rounding differences grow (Adam) and 250 steps only start the descent: it must be falling.
    assert sum(got[-10:]) < sum(got[:10])
    # The flash checkpoint went through the agents' hosts to storage, up to the last save.
    assert committed_steps(open_storage(str(ckpt)))[-1] == STEPS
