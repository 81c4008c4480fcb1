"""How fast a hang of an unmodified script (it never imports phalanx) is caught: phalanx-run against torchrun,
side by side, on the same script and the same fault.

    python -m benchmarks.plain_hang [--runs 3] [--give-up 120] [--out FILE]

The script is tests/local/plain_ddp.py (a gloo DDP loop, 0.1 s steps, 2 ranks on one machine). Two faults,
one run each per launcher:

- ``sigstop``: rank 1 gets SIGSTOP once both ranks passed step 20 of the script;
- ``never_entered``: rank 0 sleeps before the all-reduce of step 30 (``--stall-at``), alive, as a rank stuck
  in its data loader would.

phalanx: ``phalanx local --nodes 2`` with default settings (a process stopped by a signal is a hang after
``hang.stopped_s``, 2 s; a rank waiting in a collective after max(10 s, 3 x p99 step), the collective read
from its flight recorder by its lookout, ``phalanx.flight``); its summary's detection time for the SIGSTOP,
and the first failure event after the stall. torchrun:
``torchrun --nproc-per-node 2 --max-restarts 1`` with its defaults (gloo's collective timeout, 30 minutes):
the time until it restarts or ends the workers, or ``null`` when it did not within ``--give-up`` seconds.
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
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "local" / "plain_ddp.py"
FAULTS = ("sigstop", "never_entered")


def _steps(d: Path) -> list[dict[str, Any]]:
    lines = [x for f in d.glob("steps-*.jsonl") for x in f.read_text().splitlines() if x.strip()]
    return sorted((json.loads(x) for x in lines), key=lambda e: e["time"])


def _script(d: Path, fault: str) -> list[str]:
    stall = ["--stall-at", "30", "--stall-node", "node-0"] if fault == "never_entered" else []
    return [str(SCRIPT), "--dir", str(d), "--steps", "300", "--step-time", "0.1", *stall]


def _stop_rank_one_after_step_20(d: Path, deadline: float) -> float | None:
    """SIGSTOPs rank 1 once both ranks logged step 20; returns when, or None if they never did."""
    while time.monotonic() < deadline:
        entries = _steps(d)
        ranks = {e["rank"]: e["pid"] for e in entries if e["step"] >= 20}
        if len(ranks) == 2:
            os.kill(ranks[1], signal.SIGSTOP)
            return time.time()
        time.sleep(0.05)
    return None


def phalanx(fault: str, work: Path, give_up: float) -> float | None:
    d, summary = work / "d", work / "summary.json"
    inject = ["--inject", "hang-worker@step=20,node=1,rank=0"] if fault == "sigstop" else []
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "local", "--nodes", "2", "--nproc-per-node", "1",
         "--workdir", str(work / "wd"), "--summary-json", str(summary), "--timeout", f"{give_up + 60:g}s",
         *inject, "--", *_script(d, fault)],
        capture_output=True, text=True, cwd=work, timeout=give_up + 120, check=False,
    )  # fmt: skip
    s = json.loads(summary.read_text())
    if fault == "sigstop":
        f = s["failures"][0]
        return f["detected_at"] - f["injected_at"] if f["detected_at"] is not None else None
    stalled = (d / "stalled").stat().st_mtime - s["started_unix"]
    out = proc.stdout + proc.stderr
    events = [float(m[1]) for m in re.finditer(r"\[\s*([\d.]+)s\] event failure", out)]
    after = [t - stalled for t in events if t > stalled]
    return min(after) if after else None


def torchrun(fault: str, work: Path, give_up: float) -> float | None:
    d, log = work / "d", work / "torchrun.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
             "--max-restarts", "1", *_script(d, fault)],
            stdout=subprocess.DEVNULL, stderr=out, cwd=work,
            env={**os.environ, "PHALANX_NODE_ID": "node-0"}, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + give_up + 60
        if fault == "sigstop":
            faulted = _stop_rank_one_after_step_20(d, deadline)
        else:
            while not (d / "stalled").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            faulted = (d / "stalled").stat().st_mtime if (d / "stalled").exists() else None
        if faulted is None:
            return None
        # torchrun acts when a worker exits: the gloo timeout (30 min) ends the waiting rank's collective.
        while time.time() - faulted < give_up:
            if proc.poll() is not None or re.search(r"Restarting|failed \(exitcode", log.read_text()):
                return time.time() - faulted
            time.sleep(0.1)
        return None
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--give-up", type=float, default=120.0)
    p.add_argument("--note", default="", help="What else ran on the machine, for the record.")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plain_hang.json"))
    args = p.parse_args()
    runs: dict[str, dict[str, list[float | None]]] = {
        launcher: {f: [] for f in FAULTS} for launcher in ("phalanx", "torchrun")
    }
    with tempfile.TemporaryDirectory(prefix="phalanx-plain-hang-") as tmp:
        for r in range(args.runs):
            for fault in FAULTS:
                for name, launch in (("phalanx", phalanx), ("torchrun", torchrun)):
                    work = Path(tmp) / f"{name}-{fault}-{r}"
                    work.mkdir()
                    runs[name][fault].append(launch(fault, work, args.give_up))

    def median(values: list[float | None]) -> float | None:
        caught = [v for v in values if v is not None]
        return statistics.median(caught) if len(caught) == len(values) else None

    result = {
        "name": "plain_hang",
        "what": "seconds from a hang of an unmodified DDP script to its detection: phalanx-run vs torchrun",
        "give_up_s": args.give_up,
        "goal_s": "sigstop: hang.stopped_s, 2 s; never_entered: max(10 s, 3 x p99 step), 10 s at 0.1 s steps",
        "note": args.note,
        "runs": runs,
        "headline": {
            f"{name}_{fault}_s_median": median(runs[name][fault]) for name in runs for fault in FAULTS
        },  # null: not detected within give_up_s in every run
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
