"""The interval recorder on CPU: what it costs a training step, and how fast a hang is caught with it.

    python benchmarks/recorder_overhead.py [--rounds 300] [--segment 20] [--detection-runs 1] [--note TEXT]
                                           [--out FILE.json]

1. **Record cost** in a tight loop, for each write path (``c``: ``phalanx._ringwrite``, what ``enable`` uses
   where it was built; ``python``: the same ring from Python): nanoseconds per step boundary, per collective
   (``begin`` and ``end``) and per ``with collective(...)`` block. The ring laps several times.
2. **Steps/s** of a torch CPU step (an MLP's forward, backward and SGD update, ``--hidden`` wide, one thread)
   with two collectives recorded around it (``with collective(...)`` around a tensor op, as the trainer wraps
   its collectives) and ``phalanx.report_step``, in four arms:
   - ``off``: the loop without any instrumentation (``report_step`` writes the beacon only);
   - ``instrumented_off``: the same ``with collective(...)`` blocks, the recorder off (what a script that is
     instrumented pays when not under the recorder);
   - ``python`` and ``c``: the recorder on, through either write path.
   The arms take turns every ``--segment`` steps, ``--rounds`` times, in rotating order (so that a machine
   that speeds up or slows down biases none), and each segment is timed by this thread's CPU time (which time
   spent preempted by other processes on a busy machine does not inflate) and by the wall clock. An arm's
   overhead is the median over rounds of its segment's slowdown against the round's ``off`` segment.
   Goal: <= 1 % for the recorder (``c`` against ``off``).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import phalanx
import phalanx.intervals as iv
from phalanx import _ringwrite
from phalanx.api import beacon
from phalanx.api import intervals as ring
from phalanx.diagnostics.hang import p99

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "local" / "hang_ddp.py"
ARMS = ("off", "instrumented_off", "python", "c")


def record_cost(path: Path, *, native: bool, n: int = 20_000, repeats: int = 5) -> dict[str, float]:
    """Nanoseconds per record: the median of ``repeats`` loops of ``n`` (the ring laps several times)."""
    ring.create(path)
    rec = iv.Recorder(path, cuda=False, native=native)
    block: Callable[..., Any] = iv.collective if native else rec.collective
    if native:
        _ringwrite.activate(rec.writer, None, iv.group_of)
    step, begin, end = rec.writer.step, rec.begin, rec.end
    marks, colls, spans = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(n):
            step(i)
        marks.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        for _ in range(n):
            end(begin("all_reduce", "dp:0,1"))
        colls.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        for _ in range(n):
            with block("all_reduce", group="dp:0,1"):
                pass
        spans.append((time.perf_counter() - start) / n)
    if native:
        _ringwrite.activate(None, None, iv.group_of)
    rec.close()
    return {
        "step_boundary_ns": statistics.median(marks) * 1e9,
        "collective_ns": statistics.median(colls) * 1e9,
        "collective_with_ns": statistics.median(spans) * 1e9,
    }


class _Arms:
    """The four arms' recorders, and switching between them (the recorder's module state, as ``enable`` and
    ``disable`` set it)."""

    BLOCKS: dict[str, Any] = {
        "off": None,
        "instrumented_off": iv.collective,
        "python": iv._Collective,
        "c": iv.collective,
    }

    def __init__(self, rings: Path) -> None:
        self.paths = {arm: rings.with_name(f"{rings.name}-{arm}") for arm in ("python", "c")}
        self.recorders = {}
        for arm, path in self.paths.items():
            ring.create(path)
            self.recorders[arm] = iv.Recorder(path, cuda=False, native=arm == "c")

    def switch(self, arm: str) -> Any:
        """Sets ``arm``'s state and returns the collective block it wraps its ops in (None: no block)."""
        rec = self.recorders.get(arm)
        iv._recorder = rec
        phalanx._step_recorder = rec.writer if rec is not None else None
        _ringwrite.activate(rec.writer if rec is not None and arm == "c" else None, None, iv.group_of)
        return self.BLOCKS[arm]

    def close(self) -> None:
        self.switch("off")
        for arm, rec in self.recorders.items():
            rec.close()
            self.paths[arm].unlink(missing_ok=True)


class _Loop:
    """The training step: an MLP's forward, backward and SGD update, each of its two weight gradients
    "all-reduced" (a tensor op) inside a recorded collective, then ``report_step``."""

    def __init__(self, hidden: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(64, hidden)
        self.buckets = (self.model[0].weight, self.model[2].weight)

    def run(self, block: Any, steps: int) -> tuple[float, float]:
        """Runs ``steps`` steps; returns their wall and this thread's CPU seconds."""
        model, opt, x, buckets = self.model, self.opt, self.x, self.buckets
        wall, cpu = time.perf_counter(), time.thread_time()
        for step in range(steps):
            loss = model(x).square().mean()
            loss.backward()
            for p in buckets:
                if block is None:
                    p.grad.mul_(0.5)  # type: ignore[union-attr,operator]
                else:
                    with block("all_reduce", group="dp:0,1"):
                        p.grad.mul_(0.5)  # type: ignore[union-attr,operator]
            opt.step()
            opt.zero_grad()
            phalanx.report_step(step)
        return time.perf_counter() - wall, time.thread_time() - cpu


def _slowdown(times: dict[str, list[float]], arm: str) -> float:
    """The median over rounds of ``arm``'s segment against the round's ``off`` segment, in percent."""
    return statistics.median(100 * (a / o - 1) for a, o in zip(times[arm], times["off"], strict=True))


def overhead(rings: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    arms = _Arms(rings)
    try:
        for hidden in args.hidden:
            loop = _Loop(hidden)
            for arm in ARMS:  # warm up
                loop.run(arms.switch(arm), args.segment * 5)
            wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
            cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for r in range(args.rounds):
                for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
                    w, c = loop.run(arms.switch(arm), args.segment)
                    wall[arm].append(w)
                    cpu[arm].append(c)
            arms.switch("off")
            results.append(
                {
                    "hidden": hidden,
                    "rounds": args.rounds,
                    "segment_steps": args.segment,
                    "step_ms": 1000 * statistics.median(cpu["off"]) / args.segment,
                    "steps_per_s_cpu": {arm: args.segment / statistics.median(cpu[arm]) for arm in ARMS},
                    "overhead_pct": {arm: _slowdown(cpu, arm) for arm in ARMS[1:]},
                    "wall_overhead_pct": {arm: _slowdown(wall, arm) for arm in ARMS[1:]},
                    "total_cpu_overhead_pct": {
                        arm: 100 * (sum(cpu[arm]) / sum(cpu["off"]) - 1) for arm in ARMS[1:]
                    },
                }
            )
    finally:
        arms.close()
    return results


def headline(widths: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per width: the step's median time, each arm's overhead in percent (docs/benchmarks.md shows them)."""
    return {
        f"hidden_{w['hidden']}": {
            "step_ms_median": w["step_ms"],
            **{f"{arm}_overhead": pct for arm, pct in w["overhead_pct"].items()},
        }
        for w in widths
    }


def detection(run: int, workdir: Path) -> dict[str, Any]:
    wd = workdir / f"run{run}"
    d = wd / "d"
    summary = wd / "summary.json"
    wd.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "phalanx", "local", "--heartbeat-timeout", "2s",
        "--agent-arg=--grace-period=1s", "--workdir", str(wd / "wd"), "--summary-json", str(summary),
        "--nodes", "2", "--nproc-per-node", "1", "--inject", "hang-worker@step=10,node=1,rank=0",
        # the SIGSTOP stands for any hang: the recorder's verdict is measured, not the stopped process's
        "--agent-arg=--hang-stopped=1h",
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
    p.add_argument("--rounds", type=int, default=300, help="Rounds of one segment per arm, per width.")
    p.add_argument(
        "--segment", type=int, default=20, help="Steps an arm runs before the next takes its turn."
    )
    p.add_argument("--hidden", type=int, nargs="*", default=[256, 1024], help="none: skip")
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
        rings = Path("/dev/shm") / f"phalanx-bench-ring-{os.getpid()}"
        beacon_path = Path(tmp) / "beacon"
        beacon.create(beacon_path)
        os.environ[beacon.ENV_VAR] = str(
            beacon_path
        )  # report_step writes a real beacon, as under phalanx-run
        try:
            result["record_cost"] = {
                arm: record_cost(rings, native=native) for arm, native in (("python", False), ("c", True))
            }
            result["overhead"] = overhead(rings, args)
            result["headline"] = headline(result["overhead"])
            result["load_avg_1m_after_overhead"] = os.getloadavg()[0]
        finally:
            rings.unlink(missing_ok=True)
        result["detection"] = [detection(i, Path(tmp)) for i in range(args.detection_runs)]
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
