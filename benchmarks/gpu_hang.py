"""A device-side hang under ``phalanx local`` on a real GPU, end to end (about a minute a run on one H100):
the detection latency after a kernel that spins before an all-reduce (``torch.cuda._sleep``, see
tests/local/hang_nccl.py), against the default timeout max(10 s, 3 x p99 step); the verdict's side and
collective; the NCCL flight recorder the hung rank's watcher thread gave its agent; and whether training
resumed. Runs the harness of tests/local/test_gpu_hang.py ``--runs`` times.

    python -m benchmarks.gpu_hang [--runs 3] [--out benchmarks/results/gpu_hang.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from tests.local.test_gpu_hang import SPIN_AT, STEPS, TIMEOUT_S, run_local  # noqa: E402

from phalanx.diagnostics.hang import flight_recorder_summary  # noqa: E402


def one_run(tmp: Path) -> dict[str, object]:
    run = run_local(tmp, steps_total=STEPS, spin_at=SPIN_AT, timeout_s=200)
    failure = run["failure"]
    (rank,) = failure["hang"]
    trace = rank.get("nccl_trace", "")
    return {
        "detected_after_s": round(failure["unix"] - run["spin_unix"], 3),
        "side": rank["side"],
        "collective": rank.get("collective"),
        "timeout_s": rank["timeout_s"],
        "message": failure["message"],
        "flight_recorder": flight_recorder_summary(trace) if trace else "",
        "flight_recorder_chars": len(trace),
        "resumed_to_last_step": max(e["step"] for e in run["steps"]) == STEPS - 1,
        "processes": run["processes"],
        "exit_code": run["code"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="phalanx-gpu-hang-") as tmp:
            runs.append(one_run(Path(tmp)))
        print(json.dumps(runs[-1]), flush=True)
    latencies = [float(r["detected_after_s"]) for r in runs]  # type: ignore[arg-type]
    result = {
        "what": "benchmarks/gpu_hang.py: phalanx local, 1 node x 1 GPU, NCCL DDP, default hang settings; a "
        f"kernel spinning before the all-reduce of step {SPIN_AT}",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "timeout_s": TIMEOUT_S,
        "runs": runs,
        "summary": {
            "detected_after_s_median": round(statistics.median(latencies), 3),
            "detected_after_s_range": [min(latencies), max(latencies)],
            "device_side_verdicts": sum(r["side"] == "device" for r in runs),
            "with_flight_recorder": sum(bool(r["flight_recorder_chars"]) for r in runs),
            "resumed": sum(bool(r["resumed_to_last_step"]) for r in runs),
            "runs": len(runs),
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
