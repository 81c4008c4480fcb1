"""A beacon-only hang of 2 nodes: what tells the stopped rank from its victim, and whom the master charges.

    python benchmarks/hang_blame.py [--runs 6] [--note TEXT] [--out benchmarks/results/hang_blame.json]

Each run is ``phalanx local``, 2 nodes x 1 process of examples/ddp_mlp.py (gloo DDP, no interval recorder: the
beacon alone finds the hang, hang idle floor 2 s), with one rank SIGSTOPped at step 10 (node-1 in even runs,
node-0 in odd ones). While it is stopped, a sampler reads both workers' beacons and ``/proc/<pid>/stat`` every
50 ms. Per run: the node whose agent reported the hang first (the master's failure events), the node the hang
was counted against (its ``hang`` and ``hang_analysis`` events), the last beacon of each rank before the stall
(is the stopped rank's older?), and the CPU time (utime + stime) each worker used while the rank was stopped,
with the process states seen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from phalanx.agent.env import beacon_path
from phalanx.local.procs import read_beacon

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ddp_mlp.py"
SHM = Path("/dev/shm")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
NODES = ("node-0", "node-1")


def proc_stat(pid: int) -> tuple[str, float] | None:
    """(state letter, utime + stime in seconds) of ``pid``; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    # After the command name: state is field 3 of stat(5), utime 14 and stime 15.
    return fields[0], (int(fields[11]) + int(fields[12])) * TICK_S


class Sampler(threading.Thread):
    """Samples both workers' beacons and process stats until stopped."""

    def __init__(self, job_id: str) -> None:
        super().__init__(daemon=True)
        self.job_id = job_id
        self.samples: list[dict[str, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            now = time.time()
            row: dict[str, Any] = {"t": now}
            for node in NODES:
                b = read_beacon(beacon_path(shm_dir=SHM, job_id=self.job_id, node_id=node, local_rank=0))
                if b is None or b.pid <= 0:
                    continue
                st = proc_stat(b.pid)
                if st is not None:
                    row[node] = {"step": b.step, "beacon_unix": b.unix_ns / 1e9, "pid": b.pid}
                    row[node]["state"], row[node]["cpu_s"] = st
            self.samples.append(row)


def stall(samples: list[dict[str, Any]], stopped: str) -> dict[str, Any]:
    """What the samples show while ``stopped``'s rank was stopped (state T): both ranks' last beacons, the
    CPU each used per second of the stall, the states seen."""
    window = [s for s in samples if s.get(stopped, {}).get("state") == "T"]
    if len(window) < 2:
        return {"sampled": False}
    pid = window[0][stopped]["pid"]
    window = [s for s in window if s[stopped]["pid"] == pid]
    peer = next(n for n in NODES if n != stopped)
    window = [s for s in window if peer in s]
    if len(window) < 2:
        return {"sampled": False}
    first, last = window[0], window[-1]
    span = last["t"] - first["t"]
    return {
        "sampled": True,
        "seconds": round(span, 3),
        "stopped_last_step": last[stopped]["step"],
        "peer_last_step": last[peer]["step"],
        # > 0: the peer reported its last step after the stopped rank reported its own.
        "peer_beacon_lead_ms": round((last[peer]["beacon_unix"] - last[stopped]["beacon_unix"]) * 1e3, 1),
        "stopped_cpu_ms_per_s": round((last[stopped]["cpu_s"] - first[stopped]["cpu_s"]) / span * 1e3, 2),
        "peer_cpu_ms_per_s": round((last[peer]["cpu_s"] - first[peer]["cpu_s"]) / span * 1e3, 2),
        "peer_states": sorted({s[peer]["state"] for s in window}),
    }


def events(out: str) -> dict[str, Any]:
    """Who reported the hang first, and whom the master counted it against, from the run's event lines."""
    reported = re.findall(r"event failure\s+(node-\d)\s+rank \d+ on node-\d \(hang\)", out)
    charged = re.findall(r"event hang\s+\S+\s+asked .*; counted against (node-\d)", out)
    analysis = re.findall(r"event hang_analysis .*; counted against (node-\d|no node)", out)
    counted = charged[0] if charged else (analysis[0] if analysis else "?")
    return {
        "reported_first": reported[0] if reported else "?",
        "charged_at_report": bool(charged),
        "counted_against": "" if counted == "no node" else counted,
    }


def one_run(i: int, tmp: Path) -> dict[str, Any]:
    stopped = NODES[1 - i % 2]
    job_id = f"hangblame-{os.getpid()}-{i}"
    wd = tmp / f"run{i}"
    summary = wd / "summary.json"
    cmd = [
        sys.executable, "-m", "phalanx", "local", "--job-id", job_id,
        "--heartbeat-timeout", "2s", "--agent-arg=--grace-period=1s",
        "--agent-arg=--hang-floor=2s", "--agent-arg=--hang-idle-floor=2s",
        # the SIGSTOP stands for any hang, found by either beacon: not by the verdict on stopped processes
        "--agent-arg=--hang-stopped=1h",
        "--workdir", str(wd / "wd"), "--summary-json", str(summary),
        "--nodes", "2", "--nproc-per-node", "1",
        "--inject", f"hang-worker@step=10,node={stopped[-1]},rank=0",
        "--", str(SCRIPT), "--steps", "25", "--step-time", "0.05", "--ckpt", str(wd / "ckpt.pt"),
    ]  # fmt: skip
    sampler = Sampler(job_id)
    sampler.start()
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    sampler.done.set()
    sampler.join()
    out = proc.stdout + proc.stderr
    s = json.loads(summary.read_text()) if summary.exists() else {}
    failure = (s.get("failures") or [{}])[0]
    detected = failure.get("detected_at")
    return {
        "run": i,
        "stopped": stopped,
        "exit": s.get("exit", f"rc {proc.returncode}"),
        "wall_s": round(time.monotonic() - start, 2),
        "detected_s": round(detected - failure["injected_at"], 2) if detected is not None else None,
        **events(out),
        **stall(sampler.samples, stopped),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--note", default="", help="What else ran on the machine, for the record.")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hang_blame.json"))
    args = p.parse_args()
    result: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "note": args.note,
        "setup": "phalanx local, 2 nodes x 1 process, examples/ddp_mlp.py (no recorder), hang idle floor 2 s",
    }
    with tempfile.TemporaryDirectory() as tmp:
        runs = [one_run(i, Path(tmp)) for i in range(args.runs)]
    result["load_avg_1m_end"] = os.getloadavg()[0]
    result["machine"] = (
        f"{os.cpu_count()} cores, no GPU; 1-min load average {result['load_avg_1m']:.1f} at the start, "
        f"{result['load_avg_1m_end']:.1f} at the end"
    )
    sampled = [r for r in runs if r.get("sampled")]
    result["runs"] = runs
    result["summary"] = {
        "runs": len(runs),
        "reported_first_by_the_victim": sum(r["reported_first"] not in (r["stopped"], "?") for r in runs),
        "counted_against_the_stopped_node": sum(r["counted_against"] == r["stopped"] for r in runs),
        "counted_against_the_victim": sum(r["counted_against"] not in (r["stopped"], "") for r in runs),
        "counted_against_nobody": sum(r["counted_against"] == "" for r in runs),
        "peer_cpu_ms_per_s_median": statistics.median(r["peer_cpu_ms_per_s"] for r in sampled)
        if sampled
        else None,
        "stopped_cpu_ms_per_s_median": statistics.median(r["stopped_cpu_ms_per_s"] for r in sampled)
        if sampled
        else None,
        "peer_beacon_lead_ms_median": statistics.median(r["peer_beacon_lead_ms"] for r in sampled)
        if sampled
        else None,
        "peer_states_seen": sorted({st for r in sampled for st in r["peer_states"]}),
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
