"""Recovery when a whole shard is lost: a tensor- and pipeline-parallel GPT (TP=2, PP=2) on 2 nodes of 2
processes under ``phalanx local``, so every shard has one replica.

Two faults per run: at step 40 node-1 is SIGKILLed (the replacement node-2 reads stage 1 from storage; the
flash checkpoint persists every 10 steps), at step 120 one worker of node-0 is SIGKILLed (its shard is in
the node's shared memory). Reported per fault: seconds from the fault to the first completed step after
recovery and the steps lost (medians over the runs that succeeded), and per run the rounds, the most
in-place restarts any agent used (its budget is 3), and the wall time; a run whose job failed is reported
with its reason.

    .venv/bin/python -m benchmarks.shard_loss --runs 3 --out shard_loss.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.trainer._procs import worker_env  # noqa: E402

MODEL = [
    "--tp", "2", "--pp", "2", "--micro-batches", "2", "--steps", "200", "--global-batch", "8",
    "--layers", "2", "--hidden", "64", "--pace-ms", "20",
    "--ckpt-every", "5", "--persist-every", "2", "--ckpt-behind",
]  # fmt: skip
FAULTS = ["--inject", "kill-node@step=40,node=1", "--inject", "kill-worker@step=120,node=0,rank=1"]


def run_once(folder: Path) -> dict[str, object]:
    folder.mkdir(parents=True)
    summary = folder / "summary.json"
    cmd = [
        sys.executable, "-m", "phalanx.cli.main", "local", "--nodes", "2", "--nproc-per-node", "2",
        "--heartbeat-timeout", "3s", "--timeout", "240s", "--workdir", str(folder / "work"),
        "--summary-json", str(summary), f"--agent-arg=--checkpoint-dir={folder / 'ckpt'}", *FAULTS,
        "--", str(ROOT / "examples" / "gpt" / "train.py"), *MODEL,
    ]  # fmt: skip
    with (folder / "out.txt").open("wb") as out:
        subprocess.run(cmd, env=worker_env(), stdout=out, stderr=out, check=False, timeout=300)
    s = json.loads(summary.read_text())
    if s["exit"] != "succeeded":  # reported, not hidden: a spent restart budget fails the job
        return {"failed": s["reason"], "rounds": s["rounds"], "wall_s": s["wall_seconds"]}
    restarts = max(
        len(re.findall("restarting in place", log.read_text()))
        for log in (folder / "work").glob("node-*.log")
    )
    return {
        "recovered_s": {f["kind"]: f["recovered_at"] - f["injected_at"] for f in s["failures"]},
        "steps_lost": {f["kind"]: f["steps_lost"] for f in s["failures"]},
        "rounds": s["rounds"],
        "most_restarts_of_an_agent": restarts,
        "wall_s": s["wall_seconds"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            runs.append(run_once(Path(tmp) / f"run-{i}"))
            print(f"run {i}: {runs[-1]}", file=sys.stderr)
    report: dict[str, object] = {"name": "shard_loss", "runs": runs}
    ok = [r for r in runs if "failed" not in r]
    report["failed_runs"] = len(runs) - len(ok)
    for kind in ("kill-node", "kill-worker"):
        report[kind] = {
            "median_recovered_s": statistics.median(r["recovered_s"][kind] for r in ok) if ok else None,  # type: ignore[index]
            "median_steps_lost": statistics.median(r["steps_lost"][kind] for r in ok) if ok else None,  # type: ignore[index]
        }
    print(json.dumps(report))  # one line: benchmarks/run_all.py reads the last JSON line
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
