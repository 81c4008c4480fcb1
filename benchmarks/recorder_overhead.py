"""The interval recorder on CPU: what it costs a training step, and how fast a hang is caught with it.

    python benchmarks/recorder_overhead.py [--runs 21] [--detection-runs 1] [--note TEXT] [--out FILE.json]

1. **Record cost**: nanoseconds per step boundary and per collective (start and end) written into a ring.
2. **Steps/s with and without the recorder**: a torch CPU step (an MLP's forward, backward and SGD update,
   ``--hidden`` wide, one thread) with two collectives recorded around it (wrapping a tensor op, as the DDP
   comm hook and the trainer wrap theirs) and ``phalanx.report_step``; runs alternate with the recorder on and
   off, ``--runs`` pairs. The overhead is the median over the pairs of each pair's slowdown (a pair ran
   back to back, so a machine that speeds up or slows down between pairs does not bias it), beside the
   ratio of the two medians; ``cpu_overhead_pct`` is the same from the thread's CPU time, which time spent
   preempted by other processes on a busy machine does not inflate. Goal: <= 1 %.
3. **Detection latency** (``--detection-runs``, 0 to skip): ``phalanx local`` with default hang settings,
   two nodes of one rank each running a gloo DDP script with the recorder on (tests/local/hang_ddp.py); one
   rank is SIGSTOPped, later another sleeps before an all-reduce. For each: seconds from the fault to the
   hang report, against ``max(10 s, 3 x p99 step)``, and the suspect the failure event named.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import phalanx
import phalanx.intervals
from phalanx.api import beacon
from phalanx.api import intervals as ring
from phalanx.diagnostics.hang import p99

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "local" / "hang_ddp.py"


def record_cost(path: Path, n: int = 20_000, repeats: int = 5) -> dict[str, float]:
    """Nanoseconds per record: the median of ``repeats`` loops of ``n`` (the ring laps several times)."""
    rec = phalanx.intervals.Recorder(path, cuda=False)
    marks, colls, spans = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(n):
            rec.step(i)
        marks.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        for _ in range(n):
            rec.end(rec.begin("all_reduce", "dp:0,1"))
        colls.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        for _ in range(n):
            with rec.collective("all_reduce", "dp:0,1"):
                pass
        spans.append((time.perf_counter() - start) / n)
    rec.close()
    return {
        "step_boundary_ns": statistics.median(marks) * 1e9,
        "collective_ns": statistics.median(colls) * 1e9,
        "collective_with_ns": statistics.median(spans) * 1e9,
    }


def _steps_per_s(steps: int, hidden: int, recorded: bool) -> tuple[float, float]:
    """Steps per second of wall time, and per second of this thread's CPU time (which other processes on a
    busy machine disturb less: time spent preempted is not counted)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, hidden)
    group = "dp:0,1" if recorded else None
    start, cpu_start = time.perf_counter(), time.thread_time()
    for step in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        for p in (model[0].weight, model[2].weight):  # two "buckets", each a recorded collective
            if group is None:
                p.grad.mul_(0.5)  # type: ignore[union-attr,operator]
            else:
                with phalanx.intervals.collective("all_reduce", group=group):
                    p.grad.mul_(0.5)  # type: ignore[union-attr,operator]
        opt.step()
        opt.zero_grad()
        phalanx.report_step(step)
    return steps / (time.perf_counter() - start), steps / (time.thread_time() - cpu_start)


def overhead(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for hidden in args.hidden:
        per: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        phalanx.intervals.enable(path, cuda=False)  # the CPU path, even on a machine with a GPU
        rec = phalanx.intervals.recorder()
        _steps_per_s(args.steps // 4, hidden, recorded=True)  # warm up
        for _ in range(args.runs):
            for recorded in (False, True):
                phalanx._step_recorder = rec if recorded else None  # report_step records the boundary
                wall_rate, cpu_rate = _steps_per_s(args.steps, hidden, recorded=recorded)
                per[recorded].append(wall_rate)
                cpu[recorded].append(cpu_rate)
        phalanx.intervals.disable()
        off, on = statistics.median(per[False]), statistics.median(per[True])
        paired = [100 * (a - b) / a for a, b in zip(per[False], per[True], strict=True)]
        cpu_paired = [100 * (a - b) / a for a, b in zip(cpu[False], cpu[True], strict=True)]
        results.append(
            {
                "hidden": hidden,
                "step_ms": 1000 / off,
                "steps_per_s_without": per[False],
                "steps_per_s_with": per[True],
                "median_without": off,
                "median_with": on,
                "medians_overhead_pct": 100 * (off - on) / off,
                "paired_overhead_pct": paired,
                "overhead_pct": statistics.median(paired),
                "cpu_steps_per_s_without": cpu[False],
                "cpu_steps_per_s_with": cpu[True],
                "cpu_paired_overhead_pct": cpu_paired,
                "cpu_overhead_pct": statistics.median(cpu_paired),
            }
        )
    return results


def detection(run: int, workdir: Path) -> dict[str, Any]:
    wd = workdir / f"run{run}"
    d = wd / "d"
    summary = wd / "summary.json"
    wd.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "phalanx", "local", "--heartbeat-timeout", "2s",
        "--agent-arg=--grace-period=1s", "--workdir", str(wd / "wd"), "--summary-json", str(summary),
        "--nodes", "2", "--nproc-per-node", "1", "--inject", "hang-worker@step=10,node=1,rank=0",
        "--", str(SCRIPT), "--dir", str(d), "--steps", "45", "--step-time", "0.1",
        "--stall-at", "30", "--stall-node", "node-0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=wd.parent, check=False)
    out = proc.stdout + proc.stderr
    s = json.loads(summary.read_text())
    (fault,) = s["failures"]
    started = float(s["started_unix"])
    events = [
        (float(m.group(1)), m.group(2), m.group(3))
        for m in re.finditer(r"\[\s*([\d.]+)s\] event failure\s+(node-\d)\s+(.*)", out)
    ]
    stall_at = (d / "stalled").stat().st_mtime - started
    stall_event = min((e for e in events if e[0] > stall_at), default=None)
    lines = [json.loads(x) for f in d.glob("steps-*.jsonl") for x in f.read_text().splitlines() if x.strip()]
    by_pid: dict[int, list[float]] = {}
    for e in sorted(lines, key=lambda e: e["time"]):
        by_pid.setdefault(e["pid"], []).append(e["time"])
    gaps = [b - a for times in by_pid.values() for a, b in itertools.pairwise(times)]
    step_p99 = p99(gaps)
    timeout = max(10.0, 3 * step_p99)

    def suspect(text: str) -> str:
        m = re.search(r"suspects: .* never entered (\S+ #\d+ of \S+); .* on (node-\d)", text)
        return f"{m.group(2)} ({m.group(1)})" if m else ""

    sigstop_event = min((e for e in events if e[0] >= fault["injected_at"]), default=None)
    return {
        "exit": s["exit"],
        "step_p99_s": step_p99,
        "timeout_s": timeout,
        "sigstop": {
            "node": fault["node"],
            "detected_after_s": fault["detected_at"] - fault["injected_at"] if fault["detected_at"] else None,
            "suspect": suspect(sigstop_event[2]) if sigstop_event else "",
        },
        "never_entered": {
            "node": "node-0",
            "detected_after_s": stall_event[0] - stall_at if stall_event else None,
            "suspect": suspect(stall_event[2]) if stall_event else "",
        },
        "wall_s": s["wall_seconds"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=21, help="Pairs of runs (off, on) per width.")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--hidden", type=int, nargs="*", default=[256, 1024, 2048], help="none: skip")
    p.add_argument("--detection-runs", type=int, default=1)
    p.add_argument("--note", default="", help="What else ran on the machine, for the record.")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recorder_overhead.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "phalanx_source": str(Path(phalanx.__file__).resolve().parent),
        "note": args.note,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path("/dev/shm") / f"phalanx-bench-ring-{os.getpid()}"
        beacon_path = Path(tmp) / "beacon"
        beacon.create(beacon_path)
        os.environ[beacon.ENV_VAR] = str(
            beacon_path
        )  # report_step writes a real beacon, as under phalanx-run
        try:
            ring.create(path)
            result["record_cost"] = record_cost(path)
            ring.create(path)
            result["overhead"] = overhead(path, args)
            result["load_avg_1m_after_overhead"] = os.getloadavg()[0]
        finally:
            path.unlink(missing_ok=True)
        result["detection"] = [detection(i, Path(tmp)) for i in range(args.detection_runs)]
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
