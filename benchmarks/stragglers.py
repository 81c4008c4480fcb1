"""Time to flag a straggler from step times alone: a node whose CPU is capped to half during training.

Each run is ``phalanx local`` with two nodes of one rank each, with probes off, running either the
torch-free workload of the tests (``--workload independent``, ``tests/agent/workload.py --spin``: every step
burns ``--step-time`` of CPU, each rank steps on its own, so step intervals tell the slow node) or a
synchronous DDP job with the interval recorder on (``--workload ddp``, :mod:`benchmarks.ddp_spin`: the
all-reduce equalises step times, and only the compute time per step tells it). After ``--fault-after``
seconds (a healthy window first, so the nodes have baselines) node-1's processes are capped (the
``slow-cpu`` fault, a cgroup; the caps of each case are below). Time to flag is from
the fault to the master's ``straggler`` event (the node confirmed slow by its step-time checks), read from
``phalanx local``'s own event log; the run is then interrupted. A run that flags nothing within
``--give-up`` seconds counts as missed. Two setups of the master:

* ``defaults``: the shipped settings (heartbeat every 1 s; step window 32, at least 5 samples; a check
  every 10 s; 3 checks in a row);
* ``fast``: heartbeat 0.5 s, window 8, 4 samples, a check every 1 s, 3 checks in a row.

The machine has two cores, so the two spinning ranks take it whole; other load on it makes the healthy
node slower too, and a cap of half a core then halves little (the load average is recorded). So there are
two cases: ``half`` (node-1 capped at 500m, node-0 free: what the fault means on an idle machine) and
``half_of_healthy`` (both nodes capped at 150m from the start, node-1 at 75m from the fault on: half of
what the healthy node gets, even on a loaded machine). A flag of node-0, or one before the fault, is a false
one (``flagged`` false, the message kept). Needs root for the cgroups. Medians over ``--runs``; JSON on the
last line.

    .venv/bin/python -m benchmarks.stragglers --runs 3
    .venv/bin/python -m benchmarks.stragglers --runs 3 --workload ddp --cases half_of_healthy --fault-after 25
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    # Each rank steps on its own (no collective): step intervals name the slow node.
    "independent": ROOT / "tests" / "agent" / "workload.py",
    # Synchronous DDP with the interval recorder: only the compute time per step names it.
    "ddp": ROOT / "benchmarks" / "ddp_spin.py",
}
SETUPS: dict[str, list[str]] = {
    "defaults": [],
    "fast": [
        "--master-arg=--heartbeat-interval-s=0.5",
        "--master-arg=--probes-stragglers-step-window=8",
        "--master-arg=--probes-stragglers-step-min-samples=4",
        "--master-arg=--probes-stragglers-step-check-interval-s=1",
    ],
}
EVENT = re.compile(r"^\[\s*([0-9.]+)s\] event (\w+)\s+(\S*)\s*(.*)$")
INJECTED = re.compile(r"^\[\s*([0-9.]+)s\] INJECT slow-cpu on node-1")


CASES: dict[str, tuple[str, str]] = {"half": ("500m", ""), "half_of_healthy": ("75m", "150m")}
"""case -> (node-1's cap from the fault on, both nodes' cap from the start or "" for none)."""


def one_run(
    setup: str,
    *,
    workload: str,
    cpu: str,
    healthy_cpu: str,
    fault_after_s: float,
    give_up_s: float,
    step_time: float,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-stragglers-") as tmp:
        cmd = [
            sys.executable, "-m", "phalanx", "local", "--nodes", "2", "--nproc-per-node", "1",
            "--agent-arg=--no-warm-spares", "--workdir", f"{tmp}/wd", *SETUPS[setup],
            "--inject", f"slow-cpu@after={fault_after_s:g}s,node=1,cpu={cpu}",
            *(["--inject", f"slow-cpu@step=0,node=0,cpu={healthy_cpu}"] if healthy_cpu else []),
            *(["--inject", f"slow-cpu@step=0,node=1,cpu={healthy_cpu}"] if healthy_cpu else []),
            "--", str(WORKLOADS[workload]), "--steps", "1000000", "--step-time", str(step_time),
            *(["--dir", f"{tmp}/w", "--spin"] if workload == "independent" else []),
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd,
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        timer = threading.Timer(fault_after_s + give_up_s, lambda: proc.send_signal(signal.SIGINT))
        timer.start()
        events: list[tuple[float, str, str, str]] = []
        flagged: tuple[float, str] | None = None
        injected_at: float | None = None
        try:
            for line in proc.stdout:
                injected = INJECTED.match(line.strip())
                if injected and flagged is None:
                    injected_at = float(injected[1])  # the latest before the flag: the fault, not a start cap
                match = EVENT.match(line.strip())
                if not match:
                    continue
                at, kind, node, message = float(match[1]), match[2], match[3], match[4]
                events.append((at, kind, node, message))
                if kind == "straggler" and flagged is None:
                    flagged = (at, message if node == "node-1" else f"WRONG NODE {node}: {message}")
                    proc.send_signal(signal.SIGINT)
        finally:
            timer.cancel()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        started = next((at for at, kind, _, _ in events if kind == "round_complete"), 0.0)
        ratio = re.search(r"is ([0-9.]+)x the other nodes'", flagged[1]) if flagged else None
        right = flagged is not None and not flagged[1].startswith("WRONG") and flagged[0] > fault_after_s
        basis = re.search(r"median (compute time per step|step interval)", flagged[1]) if flagged else None
        return {
            "flagged": right,
            "basis": ("compute" if basis[1].startswith("compute") else "step") if basis else None,
            "time_to_flag_s": round(flagged[0] - injected_at, 2) if right and injected_at else None,
            "relative_score": float(ratio[1]) if ratio else None,
            "round_complete_at_s": started,
            "injected_at_s": injected_at,
            "message": flagged[1] if flagged else "",
        }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    times = [r["time_to_flag_s"] for r in runs if r["flagged"]]
    scores = [r["relative_score"] for r in runs if r["flagged"] and r["relative_score"]]
    return {
        "runs": len(runs),
        "flagged": len(times),
        "median_time_to_flag_s": round(statistics.median(times), 2) if times else None,
        "min_time_to_flag_s": min(times) if times else None,
        "max_time_to_flag_s": max(times) if times else None,
        "median_relative_score": round(statistics.median(scores), 2) if scores else None,
        "each": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--step-time", type=float, default=0.02, help="CPU seconds each step burns")
    p.add_argument("--fault-after", type=float, default=10.0)
    p.add_argument("--give-up", type=float, default=90.0)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="independent")
    args = p.parse_args()
    # Started in the background, a shell leaves SIGINT ignored, and so would phalanx local, which then could
    # not be interrupted; a handled signal is reset to its default across exec, an ignored one is not.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    results: dict[str, Any] = {}
    load_before = os.getloadavg()
    for case in args.cases.split(","):
        cpu, healthy_cpu = CASES[case]
        results[case] = {"cpu": cpu, "healthy_cpu": healthy_cpu or "uncapped"}
        for setup in args.setups.split(","):
            runs = []
            for _ in range(args.runs):
                run = one_run(
                    setup,
                    workload=args.workload,
                    cpu=cpu,
                    healthy_cpu=healthy_cpu,
                    fault_after_s=args.fault_after,
                    give_up_s=args.give_up,
                    step_time=args.step_time,
                )
                print(case, setup, json.dumps(run), file=sys.stderr, flush=True)
                runs.append(run)
            results[case][setup] = summarize(runs)
    print(
        json.dumps(
            {
                "name": "stragglers",
                "workload": args.workload,
                "step_time_s": args.step_time,
                "fault_after_s": args.fault_after,
                "give_up_s": args.give_up,
                "cores": os.cpu_count(),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                "unix": time.time(),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
