"""A torch-free training stand-in for agent and cluster tests: steps on a timer, checkpoints the step to a
JSON file (rank 0, atomically), reports each step with phalanx.report_step and appends one JSON line per
step to <log-dir>/steps-<pid>.jsonl. Real process, real beacons, no collectives (tests that need those
use examples/ddp_mlp.py)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import phalanx
from phalanx.api import round as round_file


def spin(cpu_s: float) -> None:
    """Busy-waits until this thread has used ``cpu_s`` of CPU time: the wall time it takes grows as the CPU
    the process may use shrinks."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def start_together(d: Path, round_no: int, rank: int, world: int, timeout_s: float = 60.0) -> None:
    """A file barrier: each rank marks its start in ``d`` and waits for the world's marks of this round."""
    (d / f"started-{round_no}-{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(d.glob(f"started-{round_no}-*"))) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks of round {round_no} did not start")
        time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument(
        "--slow-exit-rank",
        type=int,
        default=-1,
        help="at --fail-at this rank records its error (torch elastic's error file) and then takes "
        "--slow-exit-s to exit, like a rank whose teardown is slow",
    )
    p.add_argument("--slow-exit-s", type=float, default=5.0)
    p.add_argument("--regroup", action="store_true", help="announce in-process regroup capability")
    p.add_argument("--slow-node", default="", help="this node's ranks take --slow-factor times longer a step")
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument(
        "--spin",
        action="store_true",
        help="each step burns --step-time seconds of CPU time instead of sleeping, so a node whose CPU is "
        "capped (the slow-cpu fault) steps slower, as a compute-bound trainer would",
    )
    p.add_argument(
        "--finish-when-joined",
        action="store_true",
        help="finish as soon as a round with a newcomer is written (the last step of a synchronous job "
        "coinciding with it); a newcomer's ranks then never complete a step, as their peers are gone",
    )
    p.add_argument(
        "--start-together",
        action="store_true",
        help="wait for every rank of the round before step 0, as a trainer's first collective does; the "
        "ranks then step in lock step, whatever the load on the machine did to their start",
    )
    args = p.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ckpt = d / "ckpt.json"
    start = json.loads(ckpt.read_text())["step"] + 1 if ckpt.exists() else 0
    if args.regroup:
        round_file.announce_regroup()
    step_time = args.step_time * (args.slow_factor if os.environ["PHALANX_NODE_ID"] == args.slow_node else 1)
    log = (d / f"steps-{os.getpid()}.jsonl").open("a")
    first = round_file.read(Path(os.environ["PHALANX_ROUND_FILE"]))
    if args.finish_when_joined and first is not None and first.round > 1:
        print(f"rank {rank}/{world} joined round {first.round}; waiting for peers", flush=True)
        while True:
            time.sleep(1.0)
    if args.start_together:
        start_together(d, first.round if first else 0, rank, world)
    print(f"rank {rank}/{world} starting at step {start}", flush=True)
    for step in range(start, args.steps):
        if step == args.fail_at:
            error = ValueError(f"bad batch at step {step}")
            if rank == args.slow_exit_rank:
                from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

                ErrorHandler().record_exception(error)  # what @record does, before a slow teardown
                time.sleep(args.slow_exit_s)
            raise error
        if args.spin:
            spin(step_time)
        else:
            time.sleep(step_time)
        info = round_file.read(Path(os.environ["PHALANX_ROUND_FILE"]))
        if info is not None:
            rank, world = info.rank(int(os.environ["LOCAL_RANK"])), info.world_size
            if args.finish_when_joined and info.joined:
                print(f"rank {rank}/{world} finishing: {info.joined} joined round {info.round}", flush=True)
                return
        if rank == 0:
            tmp = ckpt.with_name(f".ckpt.{os.getpid()}")
            tmp.write_text(json.dumps({"step": step}))
            tmp.replace(ckpt)
        phalanx.report_step(step)
        entry = {"step": step, "time": time.time(), "rank": rank, "world": world, "pid": os.getpid()}
        entry["round"] = info.round if info else 0
        entry["node"] = os.environ["PHALANX_NODE_ID"]
        log.write(json.dumps(entry) + "\n")
        log.flush()


if __name__ == "__main__":
    main()
