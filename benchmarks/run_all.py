"""Runs every benchmark in turn and stores its JSON under benchmarks/results/ (`make bench`).

Each benchmark is a module of this package that prints one JSON object on its last stdout line. They run one
after another, never in parallel: this machine has two cores and the figures are medians of repeated runs,
which a second benchmark running beside them would skew.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "recovery": ["--runs", "5"],
    "checkpoint": ["--size-gb", "1"],
    "regroup": ["--runs", "5"],
    "master_capacity": [],
    "isolation": ["--runs", "3"],
    "probes": ["--runs", "5"],
    "shard_loss": ["--runs", "3"],
    "host_failover": ["--runs", "5"],
    "stragglers": ["--runs", "3"],
    "fleet_sim": ["--days", "7"],
    "goodput": [],  # 10 minutes per launcher, a fault every 60 s: about 35 minutes
}


def run_one(name: str, extra: list[str], *, out_dir: Path) -> dict[str, object]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *extra],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = round(time.monotonic() - started, 1)
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    if proc.returncode != 0 or not lines:
        result: dict[str, object] = {
            "name": name,
            "error": f"exit {proc.returncode}",
            "stderr_tail": proc.stderr.splitlines()[-20:],
        }
    else:
        result = json.loads(lines[-1])
    result["bench_wall_s"] = elapsed
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", default=list(BENCHMARKS), help="benchmarks to run (default: all)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.names:
        if name not in BENCHMARKS:
            parser.error(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
        print(f"== {name}", flush=True)
        result = run_one(name, BENCHMARKS[name], out_dir=args.out)
        failed += "error" in result
        print(json.dumps(result, indent=2), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
