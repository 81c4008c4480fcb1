"""Fault isolation of slow nodes: a node that still works, only slower, with and without phalanx's probes.

``phalanx local`` runs ``examples/gpt/train.py`` (3 nodes x 1 process, data parallel over gloo, see
:data:`MODEL`, a flash checkpoint every 10 steps) on a private network and, 10 s in, makes one node slow
for real:

* ``slow-cpu``: the node's processes capped at 150m CPU by a cgroup (a throttled or oversubscribed machine);
* ``slow-network``: the node's port on the private switch limited to 100 Mbit/s each way (a degraded NIC);
* ``healthy``: no fault, to count the evictions the probes get wrong on this noisy 2-core machine.

Each scenario runs in these modes:

* ``none``: no probes, what a launcher without fault isolation does (torchrun, the Kubeflow operator): the
  slow node stays and every synchronous step waits for it;
* ``confirm2`` (the default): probe rounds every 4 s, a straggler evicted when a second round confirms it;
* ``confirm1``: the first verdict evicts;
* ``confirm2_cold`` and ``confirm1_cold``: the same with every probe started cold (``--no-warm-probes``: a
  fresh process that imports torch first, as before the warm probe server).

Per run: seconds from the fault to the eviction and to the first step of the regrouped job, steps/s in
the 10 s before the fault and from 5 s after the fault (or after recovery) to the end, evictions of nodes
that were not slow. Medians over ``--runs`` runs, JSON on the last line. Needs root (namespaces, cgroups).

    .venv/bin/python -m benchmarks.isolation --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "gpt" / "train.py"
MODEL = ["--hidden", "256", "--layers", "2", "--heads", "4", "--seq-len", "64", "--global-batch", "24"]
"""1.6 M parameters: 6.3 MB of gradients all-reduced a step, about 5 GFLOP of compute per rank."""
FAULT_AT_S = 10.0
FAULTS = {
    "slow-cpu": ("slow-cpu@after=10s,node=1,cpu=150m", "node-1"),
    "slow-network": ("slow-network@after=10s,node=2,rate=100mbit", "node-2"),
    "healthy": ("", ""),
}
PROBES = ["--probes-enabled=true", "--probes-interval-s=4"]
MODES = {
    "none": [],
    "confirm2": [*PROBES, "--probes-stragglers-confirm-rounds=2"],
    "confirm1": [*PROBES, "--probes-stragglers-confirm-rounds=1"],
    "confirm2_cold": [*PROBES, "--probes-stragglers-confirm-rounds=2"],
    "confirm1_cold": [*PROBES, "--probes-stragglers-confirm-rounds=1"],
}
"""Master arguments per mode; a ``_cold`` mode also starts its agents with ``--no-warm-probes``."""
KINDS = {"slow-cpu": "matmul", "slow-network": "allgather", "healthy": "matmul,allgather"}


def completed_steps(d: Path) -> list[dict[str, Any]]:
    """One entry per step the job completed (the first rank to log it), by time; a step done again after a
    regroup counts again."""
    first: dict[tuple[int, int], float] = {}
    for f in d.glob("steps-*.jsonl"):
        for line in f.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "step":
                key = (event["round"], event["step"])
                first[key] = min(first.get(key, event["time"]), event["time"])
    return sorted(({"step": step, "time": t} for (_, step), t in first.items()), key=lambda e: e["time"])


def rate(steps: list[dict[str, Any]], start: float, end: float) -> float | None:
    """Steps per second completed between two unix times (None when the window is empty)."""
    done = [s for s in steps if start <= s["time"] < end]
    return len(done) / (end - start) if done and end > start else None


def one_run(scenario: str, mode: str, *, steps: int) -> dict[str, Any]:
    spec, slow_node = FAULTS[scenario]
    with tempfile.TemporaryDirectory(prefix="bench-isolation-") as tmp:
        d = Path(tmp)
        argv = [
            sys.executable, "-m", "phalanx", "local", "--nodes", "2:3", "--nproc-per-node", "1",
            "--agent-arg=--no-warm-spares", "--workdir", str(d / "wd"), "--summary-json", str(d / "s.json"),
            "--private-network", "--timeout", "600s",
            *(f"--master-arg={a}" for a in MODES[mode]),
            *(["--agent-arg=--no-warm-probes"] if mode.endswith("_cold") else []),
            *([f"--master-arg=--probes-kinds={KINDS[scenario]}"] if MODES[mode] else []),
            *(["--inject", spec] if spec else []),
            "--", str(SCRIPT), "--steps", str(steps), *MODEL, "--ckpt", "flash", "--ckpt-every", "10",
            "--log-json", str(d / "steps-{pid}.jsonl"),
        ]  # fmt: skip
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=660, check=False)
        if not (d / "s.json").exists():
            return {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-2000:]}
        s = json.loads((d / "s.json").read_text())
        log = completed_steps(d)
    failure = s["failures"][0] if s["failures"] else {}
    fault_at = failure.get("injected_at", FAULT_AT_S)  # seconds after the start, as every "at"
    start_unix = s["started_unix"]
    fault_unix = start_unix + fault_at
    evictions = s["evictions"]
    ours = [e for e in evictions if e["node_id"] == slow_node]
    false = [e for e in evictions if e["node_id"] != slow_node]
    recovered = failure.get("recovered_at")
    resume_unix = start_unix + recovered if recovered is not None else fault_unix
    return {
        "exit": s["exit"],
        "wall_s": s["wall_seconds"],
        "eviction_s": ours[0]["at"] - fault_at if ours else None,
        "recovery_s": recovered - fault_at if recovered is not None else None,
        "false_evictions": len(false),
        "false_eviction_reasons": [
            f"{e['at'] - fault_at:.1f}s after the fault: {e['reason']}" for e in false
        ],
        "steps_per_s_before": rate(log, max(log[0]["time"], fault_unix - 10.0), fault_unix),
        "steps_per_s_after": rate(log, resume_unix + 5.0, log[-1]["time"]),
    }


def median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--scenarios", default=",".join(FAULTS))
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    results: dict[str, Any] = {}
    for scenario in args.scenarios.split(","):
        results[scenario] = {}
        for mode in args.modes.split(","):
            if scenario == "healthy" and mode == "none":
                continue  # nothing to isolate and nobody to evict
            runs = [one_run(scenario, mode, steps=args.steps) for _ in range(args.runs)]
            ok = [r for r in runs if "error" not in r]
            results[scenario][mode] = {
                "runs": len(runs),
                "failed_runs": [r for r in runs if "error" in r or r["exit"] != "succeeded"],
                **{
                    key: median([r[key] for r in ok])
                    for key in (
                        "eviction_s",
                        "recovery_s",
                        "steps_per_s_before",
                        "steps_per_s_after",
                        "wall_s",
                    )
                },
                "evicted_the_slow_node": sum(r["eviction_s"] is not None for r in ok),
                "false_evictions": sum(r["false_evictions"] for r in ok),
                "false_eviction_reasons": [why for r in ok for why in r["false_eviction_reasons"]],
            }
            print(scenario, mode, json.dumps(results[scenario][mode]), file=sys.stderr, flush=True)
    print(
        json.dumps({"name": "isolation", "fault_at_s": FAULT_AT_S, "steps": args.steps, "results": results})
    )


if __name__ == "__main__":
    main()
