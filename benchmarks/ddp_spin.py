"""A synchronous DDP job (gloo, CPU) whose compute is CPU-bound, with phalanx's interval recorder on: the
workload of ``benchmarks.stragglers --workload ddp``.

Each step burns ``--step-time`` seconds of CPU time (the forward pass of a real model stands in for the
rest), then the backward pass all-reduces the gradients through DDP. The all-reduce makes every rank's step as
long as the slowest rank's, so step times cannot tell which node is slow; the recorder (its DDP comm hook)
times each all-reduce, and the master compares the compute time per step (step minus collective time).
Run it under ``phalanx-run``/``phalanx local`` (without an agent the recorder is off).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import phalanx
import phalanx.intervals


def spin(cpu_s: float) -> None:
    """Busy-waits until this thread has used ``cpu_s`` of CPU time."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-time", type=float, default=0.02, help="CPU seconds of compute a step")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DistributedDataParallel(model)
    recording = phalanx.intervals.register_ddp(ddp)
    if dist.get_rank() == 0:
        print(f"world size {dist.get_world_size()}, recorder {'on' if recording else 'off'}", flush=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        spin(args.step_time)
        x = torch.randn(64, 32, generator=gen)
        loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()  # the all-reduce: waits for the slowest rank
        opt.step()
        phalanx.report_step(step)


if __name__ == "__main__":
    main()
