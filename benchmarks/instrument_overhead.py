"""What phalanx-run's default instrumentation (phalanx.instrument) costs an unmodified script's CPU step.

    python -m benchmarks.instrument_overhead [--rounds 200] [--segment 20] [--hidden 128 256] [--out FILE]

One process, a gloo group of one rank, a script's loop as it would be written without phalanx: an MLP's
forward and backward, its two weight gradients all-reduced with ``dist.all_reduce`` (real c10d collectives,
through gloo), an optimizer step (SGD, or Adam with ``--optimizer adam``). torch keeps its flight recorder, as
phalanx-run sets it (``TORCH_FR_BUFFER_SIZE``), in every arm. Three arms take turns every ``--segment``
steps, ``--rounds`` times, in an order that rotates:

- ``off``: nothing of phalanx runs on the training thread (what ``--no-instrument`` leaves);
- ``on``: what the bootstrap installs: the optimizer-step hook (a step published to the beacon and the
  interval ring through the C write path), c10d's pre/post hooks on the group for one step each
  ``instrument.SAMPLE_GAP_S``, and the flight-recorder lookout on the recorder's watcher thread
  (phalanx.flight), which reads nothing while the steps go on;
- ``every``: the same with c10d's hooks on for every step (each all-reduce's start, and its end when its
  work completes): what the instrumentation did before the lookout, and still does on a GPU or where torch
  keeps no flight recorder.

Each segment is timed by this thread's CPU time (which time spent preempted on a busy machine does not
inflate) and by the wall clock; an arm's overhead is the median over rounds of its segment against the
round's ``off`` segment. Goal: <= 1 % (the recorder's own goal, docs/hangs.md).
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
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

import phalanx
from phalanx import instrument
from phalanx import intervals as iv
from phalanx.agent.env import FR_ENTRIES, FR_ENV
from phalanx.api import beacon
from phalanx.api import intervals as ring

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("off", "on", "every")


class _Arms:
    """Switches the instrumentation of this process on and off between segments."""

    def __init__(self) -> None:
        self.handle: Any = None

    def switch(self, arm: str) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        groups = instrument._steps.groups
        groups.unhook_all()
        groups.sampling = False
        phalanx._step_recorder = None
        if arm == "off":
            return
        self.handle = register_optimizer_step_post_hook(instrument._steps.on_step)
        rec = iv.recorder()
        if rec is not None:  # enabled, and the lookout asked for, by the first step of the first segment on
            phalanx._step_recorder = rec.writer
            groups.every_step = arm == "every" or rec._lookout is None


class _Loop:
    def __init__(self, hidden: int, optimizer: str) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )
        params = self.model.parameters()
        self.opt = (
            torch.optim.Adam(params, lr=1e-3) if optimizer == "adam" else torch.optim.SGD(params, lr=1e-3)
        )
        self.x = torch.randn(64, hidden)
        self.buckets = (self.model[0].weight, self.model[2].weight)

    def run(self, steps: int) -> tuple[float, float]:
        model, opt, x, buckets = self.model, self.opt, self.x, self.buckets
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            model(x).square().mean().backward()
            for p in buckets:
                dist.all_reduce(p.grad)  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - wall, time.thread_time() - cpu


def _slowdown(times: dict[str, list[float]], arm: str) -> float:
    return statistics.median(100 * (a / o - 1) for a, o in zip(times[arm], times["off"], strict=True))


def measure(hidden: int, args: argparse.Namespace) -> dict[str, Any]:
    arms, loop = _Arms(), _Loop(hidden, args.optimizer)
    for arm in ARMS * 3:  # warm up (and enable the recorder once)
        arms.switch(arm)
        loop.run(args.segment * 5)
    rec = iv.recorder()
    wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        k = r % len(ARMS)
        for arm in ARMS[k:] + ARMS[:k]:
            arms.switch(arm)
            w, c = loop.run(args.segment)
            wall[arm].append(w)
            cpu[arm].append(c)
    arms.switch("off")
    return {
        "hidden": hidden,
        "optimizer": args.optimizer,
        "rounds": args.rounds,
        "segment_steps": args.segment,
        "lookout": rec is not None and rec._lookout is not None,
        "lookout_reads": rec._lookout.reads if rec is not None and rec._lookout is not None else None,
        "step_ms": 1000 * statistics.median(cpu["off"]) / args.segment,
        "overhead_pct": _slowdown(cpu, "on"),
        "wall_overhead_pct": _slowdown(wall, "on"),
        "every_step_overhead_pct": _slowdown(cpu, "every"),
        "every_step_wall_overhead_pct": _slowdown(wall, "every"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--segment", type=int, default=20)
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 256])
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--note", default="", help="What else ran on the machine, for the record.")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "instrument_overhead.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault(FR_ENV, FR_ENTRIES)  # as phalanx-run sets it for its workers
    with tempfile.TemporaryDirectory(prefix="phalanx-instrument-") as tmp:
        rings, beacon_file = Path(tmp) / "ring", Path(tmp) / "beacon"
        ring.create(rings)
        os.environ[ring.ENV_VAR], os.environ[beacon.ENV_VAR] = str(rings), str(beacon_file)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            widths = [measure(h, args) for h in args.hidden]
        finally:
            dist.destroy_process_group()
    result = {
        "name": "instrument_overhead",
        "what": "CPU cost of phalanx-run's default instrumentation on an unmodified script's step",
        "goal_pct": 1.0,
        "native_writer": iv._ringwrite is not None,
        "torch": torch.__version__,
        "note": args.note,
        "widths": widths,
        "headline": {  # overhead: percent of the step's CPU time
            f"hidden_{w['hidden']}": {
                "step_ms_median": w["step_ms"],
                "overhead": w["overhead_pct"],
                "every_step_overhead": w["every_step_overhead_pct"],
            }
            for w in widths
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
