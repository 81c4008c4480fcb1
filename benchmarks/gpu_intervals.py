"""The interval recorder on a GPU (well under 2 minutes on one H100): overhead on a bf16 matmul training-like
loop with and without the recorder, and detection of a device-side hang made with ``torch.cuda._sleep``.

    python benchmarks/gpu_intervals.py [--out benchmarks/results/gpu_intervals.json]

1. **Overhead.** Each step: ``--matmuls`` bf16 matmuls of ``--size`` squared, one of them wrapped as a
   recorded "collective" (its start and end are CUDA events), and a step boundary (a device marker). Runs of
   ``--steps`` steps alternate with and without the recorder; steps/s is taken per run (synchronised at the
   end of the run only, as training does), and the medians are compared. Goal: <= 1 %.
2. **Device-side hang.** After a few normal steps, a "collective" whose kernel spins for ``--spin`` seconds
   (``torch.cuda._sleep``) is recorded and the host blocks in ``torch.cuda.synchronize()``. An agent-side loop
   (the ring reader, the tracker and :func:`phalanx.diagnostics.hang.evidence_verdict`, as the node agent runs
   them every 0.1 s) judges it; the verdict's side must be "device" and its latency after the launch is
   compared with the timeout ``max(floor, 3 x p99 step)`` (``--floor``: 2 s here to keep the run short; the
   default setting is 10 s).

Prints one JSON document (and writes it with ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from phalanx.api import intervals as ring  # noqa: E402
from phalanx.api.interval_tracker import Tracker  # noqa: E402
from phalanx.api.settings import HangSettings  # noqa: E402
from phalanx.diagnostics import hang  # noqa: E402
from phalanx.intervals import Recorder  # noqa: E402


def _step(a: torch.Tensor, b: torch.Tensor, matmuls: int, rec: Recorder | None, step: int) -> torch.Tensor:
    x = a
    for i in range(matmuls):
        if rec is not None and i == matmuls - 1:
            with rec.collective("all_reduce", "dp:0"):
                x = x @ b
        else:
            x = x @ b
    if rec is not None:
        rec.step(step)
    return x


def _run(a: torch.Tensor, b: torch.Tensor, *, steps: int, matmuls: int, rec: Recorder | None) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for s in range(steps):
        _step(a, b, matmuls, rec, s)
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - start)


def overhead(args: argparse.Namespace, path: Path) -> dict[str, object]:
    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16) / args.size**0.5
    rec = Recorder(path, cuda=True)
    reader = ring.RingReader(path)
    drained = threading.Event()

    def drain() -> None:  # the agent's reads, so the ring is read as in production
        while not drained.is_set():
            reader.read()
            time.sleep(0.1)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    _run(a, b, steps=args.steps // 2, matmuls=args.matmuls, rec=None)  # warm up cuBLAS
    _run(a, b, steps=args.steps // 2, matmuls=args.matmuls, rec=rec)
    without, with_ = [], []
    for _ in range(args.runs):
        without.append(_run(a, b, steps=args.steps, matmuls=args.matmuls, rec=None))
        with_.append(_run(a, b, steps=args.steps, matmuls=args.matmuls, rec=rec))
    drained.set()
    t.join()
    rec.close()
    m0, m1 = statistics.median(without), statistics.median(with_)
    return {
        "size": args.size,
        "matmuls_per_step": args.matmuls,
        "steps_per_run": args.steps,
        "runs": args.runs,
        "steps_per_s_without": without,
        "steps_per_s_with": with_,
        "median_without": m0,
        "median_with": m1,
        "overhead_pct": 100.0 * (m0 - m1) / m0,
        "goal_pct": 1.0,
    }


def _cycles_per_second() -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    return 200_000_000 / (time.perf_counter() - start)


def device_hang(args: argparse.Namespace, path: Path) -> dict[str, object]:
    settings = HangSettings(floor_s=args.floor)
    rec = Recorder(path, cuda=True)
    reader, tracker = ring.RingReader(path), Tracker()
    history = hang.RankHistory(started_at=time.monotonic())
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    cycles = _cycles_per_second()
    found: dict[str, object] = {}
    launched = [0]
    stop = threading.Event()

    def agent() -> None:  # what the node agent does every monitoring tick
        while not stop.is_set():
            tracker.feed(reader.read())
            act = tracker.activity() if tracker.active else None
            if tracker.last_mark is not None:
                history.observe(step=tracker.last_mark.number, now=time.monotonic())
            v = hang.evidence_verdict(
                history, settings, now=time.monotonic(), activity=act, now_unix_ns=time.time_ns()
            )
            if v.hung and launched[0]:
                found.update(
                    side=v.side,
                    reason=hang.describe(0, v),
                    timeout_s=v.timeout_s,
                    detected_after_launch_s=(time.time_ns() - launched[0]) / 1e9,
                )
                return
            time.sleep(0.1)

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    for s in range(30):  # normal steps build the step history
        with rec.collective("all_reduce", "dp:0"):
            _ = a @ a
        rec.step(s)
        torch.cuda.synchronize()
        time.sleep(0.02)
    launched[0] = time.time_ns()
    token = rec.begin("all_reduce", "dp:0")
    torch.cuda._sleep(int(args.spin * cycles))  # a collective that never finishes, as far as anyone can tell
    rec.end(token)
    host_returned_s = (time.time_ns() - launched[0]) / 1e9
    torch.cuda.synchronize()  # the host blocks, as training does at its next sync
    t.join(timeout=5)
    stop.set()
    rec.close()
    found["host_returned_after_s"] = host_returned_s  # no synchronisation on the training path
    found["spin_s"] = args.spin
    found["floor_s"] = args.floor
    found["ok"] = found.get("side") == "device"
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--matmuls", type=int, default=8)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--floor", type=float, default=2.0)
    p.add_argument("--spin", type=float, default=6.0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    path = Path("/dev/shm") / f"phalanx-bench-ring-{os.getpid()}"
    try:
        ring.create(path)
        result: dict[str, object] = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "overhead": overhead(args, path),
        }
        ring.create(path)
        result["device_hang"] = device_hang(args, path)
    finally:
        path.unlink(missing_ok=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
