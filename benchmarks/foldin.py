"""A node loss in `make demo`'s set-up: what folding the replacement in costs, against what training on at
the smaller world gains, and the goodput of "train on, fold in" against "wait for the replacement".

Each run is `make demo`'s job (``phalanx local``, 3 nodes x 1 process, ``examples/ddp_mlp.py --flash``:
gloo, every step saved to shared memory, persisted every 10; ``--heartbeat-timeout 3s --replace-delay 0s``)
with one ``kill-node`` of node-2, and more steps than the demo, so that the replacement is folded in while
the job still trains. From the run's summary (``--summary-json``) and rank 0's step log:

- ``t3_s`` / ``t2_s``: the median step time at world 3 (before the kill) and world 2 (the survivors alone);
- ``reform_s``: the kill to the first step at world 2 (the survivors' restart);
- ``world2_s`` and ``world2_steps``: how long, and how many steps, the survivors trained alone, until the
  round that folds the replacement in opened;
- ``fold_in_cost_s``: that round opening to the first step with the replacement, in two parts:
  ``fold_in_gather_s`` (opening to the round formed: the survivors stop their workers, save at breakpoint
  and join) and ``fold_in_restart_s`` (formed to the first step: processes, restore, the first step);
  ``fold_in_lost``: the steps trained again after it.

Goodput (per-rank batch fixed: a step at world 2 trains 2/3 of a world-3 step's samples), both counted as
seconds of the full world's training lost between the kill and the first step with the replacement (the
replacement joins at the same moment either way: it starts when the lost node is evicted):

- train on (what phalanx does): ``window - world2_steps * 2/3 * t3_s``;
- wait for the replacement (the counterfactual, from the same run): nothing trains until the replacement
  joins, the survivors wait in the open round (stopped and saved already), and that round's restart costs
  what the fold-in's restart part cost: ``join - kill + fold_in_restart_s``.

Train on wins by ``world2_steps * 2/3 * t3_s - fold_in_gather_s``: what the survivors trained alone, less
the second stop of their workers.

    .venv/bin/python -m benchmarks.foldin --runs 3 --out benchmarks/results/foldin.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "ddp_mlp.py"


def _median_step(times: list[float]) -> float | None:
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else None


def _median_name(key: str) -> str:
    """``t3_s`` -> ``t3_median_s``: the benchmarks page shows the figures whose names say median."""
    return f"{key.removesuffix('_s')}_median" + ("_s" if key.endswith("_s") else "")


def one_run(work: Path, *, steps: int, kill_at: int, step_time: float) -> dict[str, Any]:
    summary_path, step_log = work / "summary.json", work / "steps.jsonl"
    cmd = [
        sys.executable, "-m", "phalanx", "local", "--nodes", "2:3", "--nproc-per-node", "1",
        "--heartbeat-timeout", "3s", "--replace-delay", "0s", "--inject", f"kill-node@step={kill_at},node=2",
        "--workdir", str(work / "cluster"), "--summary-json", str(summary_path), "--timeout", "300s",
        "--", str(SCRIPT), "--steps", str(steps), "--step-time", str(step_time), "--flash",
        "--persist-every", "10", "--step-log", str(step_log),
    ]  # fmt: skip
    env = {**os.environ, "PHALANX_CHECKPOINT_STORAGE_PATH": str(work / "ckpt"), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360, check=False)
    (work / "output.txt").write_text(out.stdout + out.stderr)
    summary = json.loads(summary_path.read_text())
    (fault,) = summary["failures"]
    fold = fault.get("fold_in") or {}
    log = [json.loads(line) for line in step_log.read_text().splitlines()]
    t0 = summary["started_unix"]
    kill = fault["injected_at"]
    w3 = [e["time"] for e in log if e["world_size"] == 3 and e["step"] >= 10 and e["time"] - t0 < kill]
    w2 = [e for e in log if e["world_size"] == 2]
    t3, t2 = _median_step(w3), _median_step([e["time"] for e in w2])
    row: dict[str, Any] = {
        "exit": summary["exit"],
        "kill_at_s": kill,
        "t3_s": t3,
        "t2_s": t2,
        "reform_s": fault["recovered_at"] - kill if fault.get("recovered_at") is not None else None,
        "world2_steps": len(w2),
        "fold_in": fold,
        "action": fault["action"],
    }
    if fold.get("opened_at") is None or fold.get("cost_s") is None or t3 is None:
        return row
    world2_end = fold["opened_at"]
    window = fold["folded_at"] - kill
    row["world2_s"] = world2_end - kill - row["reform_s"]
    row["fold_in_cost_s"] = fold["cost_s"]
    row["fold_in_gather_s"] = fold["formed_at"] - fold["opened_at"]
    row["fold_in_restart_s"] = fold["folded_at"] - fold["formed_at"]
    row["fold_in_lost"] = fold["steps_lost"]
    row["train_on_lost_s"] = window - len(w2) * 2 / 3 * t3
    row["wait_lost_s"] = world2_end - kill + row["fold_in_restart_s"]
    row["train_on_gain_s"] = row["wait_lost_s"] - row["train_on_lost_s"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=110)
    p.add_argument("--step-time", type=float, default=0.08)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for i in range(args.runs):
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="phalanx-foldin.") as tmp:
            row = one_run(Path(tmp), steps=args.steps, kill_at=args.kill_at, step_time=args.step_time)
        # What else ran: the runs are only comparable with each other at a similar load.
        row["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if i + 1 < args.runs:
            time.sleep(2.0)
    done = [r for r in rows if "fold_in_cost_s" in r]

    def med(key: str) -> float | None:
        values = [r[key] for r in done if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    loads = [x for r in rows for x in r["load_1min"]]
    result = {
        "benchmark": "foldin",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": (
            f"{os.cpu_count()} cores, no GPU; 1-min load average {min(loads):g}-{max(loads):g} in the runs"
        ),
        "setup": {
            "nodes": 3,
            "nproc_per_node": 1,
            "script": "examples/ddp_mlp.py --flash --persist-every 10",
            "steps": args.steps,
            "kill_node_at_step": args.kill_at,
            "step_time_s": args.step_time,
            "heartbeat_timeout_s": 3,
        },
        "median": {
            _median_name(key): med(key)
            for key in (
                "t3_s",
                "t2_s",
                "reform_s",
                "world2_s",
                "world2_steps",
                "fold_in_cost_s",
                "fold_in_gather_s",
                "fold_in_restart_s",
                "fold_in_lost",
                "train_on_lost_s",
                "wait_lost_s",
                "train_on_gain_s",
            )
        },
        "runs": rows,
    }
    print(json.dumps(result["median"], indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
