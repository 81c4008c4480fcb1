"""Runs every benchmark in turn and stores its JSON under benchmarks/results/ (`make bench`).

Each benchmark is a module of this package that prints one JSON object on its last stdout line. They run one
after another, never in parallel: this machine has two cores and the figures are medians of repeated runs,
which a second benchmark running beside them would skew.

``--quick`` (`make bench QUICK=1`) runs each benchmark once, small (one run per arm, short jobs, small
sizes), into benchmarks/results/quick/, which git ignores: it shows that every benchmark runs end to end on
this machine, both sides of each comparison included, in minutes instead of hours. Its figures are single
runs and not comparable with the committed results; it fails when any benchmark fails or reports an error
in one of its arms. CI runs it after `make test` (scripts/readme-check).
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
QUICK = {
    "recovery": ["--runs", "1", "--steps", "60", "--kill-step", "30"],
    "checkpoint": ["--size-gb", "0.05", "--repeats", "1", "--first-runs", "1"],
    "regroup": ["--runs", "1", "--overhead-steps", "200"],
    "master_capacity": ["--nodes", "100", "--seconds", "2", "--concurrency", "32"],
    "isolation": ["--runs", "1", "--steps", "120", "--scenarios", "slow-cpu", "--modes", "none,confirm2"],
    "probes": ["--runs", "1"],
    "shard_loss": ["--runs", "1"],
    "host_failover": ["--runs", "1"],
    "stragglers": ["--runs", "1", "--cases", "half", "--setups", "fast"],
    "fleet_sim": [
        "--nodes", "512", "--days", "1", "--rendezvous-sizes", "100", "--rendezvous-runs", "1",
        "--grpc-nodes", "100", "--grpc-runs", "1", "--echo-nodes", "64",
    ],
    "goodput": ["--minutes", "1", "--interval", "20"],
}  # fmt: skip
"""Each benchmark's arguments under ``--quick``: one run, small and short, every arm still there."""


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


def arm_errors(result: object, path: str = "") -> list[str]:
    """Every ``error`` a benchmark's JSON reports, at any depth (an arm that could not run says so in its
    own ``error`` key while the others ran), with where it is."""
    if isinstance(result, dict):
        found = [f"{path or 'benchmark'}: {result['error']}"] if result.get("error") else []
        for key, value in result.items():
            found += arm_errors(value, f"{path}.{key}" if path else str(key))
        return found
    if isinstance(result, list):
        return [e for i, value in enumerate(result) for e in arm_errors(value, f"{path}[{i}]")]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", default=list(BENCHMARKS), help="benchmarks to run (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/, or results/quick/")
    parser.add_argument("--quick", action="store_true", help="each benchmark once and small (see above)")
    args = parser.parse_args()
    plan = QUICK if args.quick else BENCHMARKS
    out = args.out or HERE / "results" / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.names:
        if name not in BENCHMARKS:
            parser.error(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
        print(f"== {name}", flush=True)
        result = run_one(name, plan[name], out_dir=out)
        if errors := arm_errors(result):
            failed += 1
            print(f"== {name}: FAILED: {'; '.join(errors)}", flush=True)
        print(json.dumps(result, indent=2), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
