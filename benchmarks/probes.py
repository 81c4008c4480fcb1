"""Health-probe start-up cost: a cold probe process against one forked from phalanx's warm probe server.

A cold probe is a fresh Python process that imports torch before it measures anything, as the agent's
probes were before the warm server, and as DLRover's node check runs its checks. A warm probe is forked from
the agent's probe server (:mod:`phalanx.diagnostics.probe_server`), which imported torch once. Both run the
agent's matmul probe (``--seconds`` of measuring); per probe, the overhead is its wall time from the request
to the measurements minus those seconds.

Two nodes: an idle one, and one capped at 150m CPU by a cgroup (the straggler a probe round is looking for,
and the node whose probes the round waits for). The warm server is started before each case's measured runs;
its first probe, which pays for the import, is reported apart as ``first_warm_s``. Medians over ``--runs``;
JSON on the last line. The capped node needs root (it makes a cgroup); without it that case has an error.

    .venv/bin/python -m benchmarks.probes --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.agent.probes import MATMUL_SECONDS, MATMUL_TIMEOUT_S
from phalanx.api.errors import ConfigError
from phalanx.diagnostics.probe_runner import Measurement, matmul_args, run_probe
from phalanx.diagnostics.warm_probes import WarmProbes
from phalanx.local.cpulimit import CpuGroup

CAP_CPUS = 0.15


def timed(probe: Callable[[], list[Measurement] | None]) -> float:
    started = time.monotonic()
    measured = probe()
    took = time.monotonic() - started
    if not measured or not all(m.ok for m in measured):
        raise RuntimeError(f"the probe failed: {measured}")
    return took


def one_case(python: str, *, runs: int) -> dict[str, Any]:
    args = matmul_args(seconds=MATMUL_SECONDS)
    cold = [
        timed(lambda: run_probe(kind="matmul", python=python, args=args, timeout_s=MATMUL_TIMEOUT_S))
        for _ in range(runs)
    ]
    warm = WarmProbes(python=python)
    try:
        first = timed(lambda: warm.run(kind="matmul", args=args, timeout_s=MATMUL_TIMEOUT_S))
        forked = [
            timed(lambda: warm.run(kind="matmul", args=args, timeout_s=MATMUL_TIMEOUT_S)) for _ in range(runs)
        ]
    finally:
        warm.close()
    cold_s, warm_s = statistics.median(cold), statistics.median(forked)
    return {
        "cold_s": round(cold_s, 3),
        "warm_s": round(warm_s, 3),
        "first_warm_s": round(first, 3),
        "cold_overhead_s": round(cold_s - MATMUL_SECONDS, 3),
        "warm_overhead_s": round(warm_s - MATMUL_SECONDS, 3),
        "overhead_ratio_warm_to_cold": round((warm_s - MATMUL_SECONDS) / (cold_s - MATMUL_SECONDS), 3),
        "runs": runs,
    }


def capped_case(*, runs: int) -> dict[str, Any]:
    try:
        group = CpuGroup(f"phalanx-bench-probes-{os.getpid()}")
    except ConfigError as exc:
        return {"error": str(exc)}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-probes-") as tmp:
            python = Path(tmp, "python")  # joins the group, then is the interpreter: probes and server alike
            python.write_text(
                f'#!/bin/sh\necho $$ > {group.path / "cgroup.procs"} && exec {sys.executable} "$@"\n'
            )
            python.chmod(0o755)
            group.limit(CAP_CPUS)
            return {"cpus": CAP_CPUS, **one_case(str(python), runs=runs)}
    finally:
        group.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    results = {"idle": one_case(sys.executable, runs=args.runs)}
    print("idle", json.dumps(results["idle"]), file=sys.stderr, flush=True)
    results["cpu_capped"] = capped_case(runs=args.runs)
    print(json.dumps({"name": "probes", "matmul_seconds": MATMUL_SECONDS, "results": results}))


if __name__ == "__main__":
    main()
