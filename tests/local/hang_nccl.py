"""A small NCCL DDP training script on one GPU per rank, with the interval recorder on, for the device-side
hang test (tests/local/test_gpu_hang.py) and its benchmark (benchmarks/gpu_hang.py): each step is one
forward, one backward (DDP all-reduces the gradients through phalanx's comm hook, which records the
all-reduce's end as a CUDA event), the loss read back with ``.item()`` (the host waits for the device there,
as training that logs its loss does) and ``phalanx.report_step``. Rank 0 checkpoints the step (a JSON file)
so a restarted round resumes; every rank appends one JSON line per step to ``<dir>/steps-<pid>.jsonl``.

``--spin-at S`` makes local rank 0 of every node queue a kernel that spins for ``--spin-s`` seconds
(``torch.cuda._sleep``) before step S's backward pass, once (a marker file remembers it): the all-reduce
queued behind it never completes as far as anyone can tell, the host blocks in ``.item()``, and only the
device knows why. ``<dir>/spin.json`` says when the kernel was queued (unix seconds).

``--backend gloo`` runs the same loop on the CPU, where the spin is a host-side sleep (a check of the script
and its harness on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import phalanx
import phalanx.intervals


def _cycles_per_second(device: torch.device) -> float:
    """The spin kernel's clock: ``torch.cuda._sleep`` counts cycles, not seconds."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize(device)
    return 100_000_000 / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--spin-at", type=int, default=-1)
    p.add_argument("--spin-s", type=float, default=600.0)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    args = p.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    assert phalanx.intervals.register_ddp(ddp)
    recorder = phalanx.intervals.recorder()
    assert recorder is not None
    assert recorder.cuda == (device.type == "cuda"), "on a GPU the recorder times with CUDA events"
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    ckpt = d / "ckpt.json"
    start = json.loads(ckpt.read_text())["step"] + 1 if ckpt.exists() else 0
    log = (d / f"steps-{os.getpid()}.jsonl").open("a")
    marker = d / "spun"
    spin_cycles = int(args.spin_s * _cycles_per_second(device)) if device.type == "cuda" else 0
    print(f"rank {rank}/{world} on {device} starting at step {start}", flush=True)
    x = torch.randn(64, 256, device=device)
    for step in range(start, args.steps):
        loss = ddp(x).square().mean()
        if step == args.spin_at and local_rank == 0 and not marker.exists():
            marker.write_text(str(rank))
            (d / "spin.json").write_text(json.dumps({"unix": time.time(), "rank": rank, "step": step}))
            print(f"rank {rank} spins {args.spin_s:.0f} s before the all-reduce of step {step}", flush=True)
            if spin_cycles:
                torch.cuda._sleep(spin_cycles)
            else:
                time.sleep(args.spin_s)  # on the CPU the host stalls instead
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()  # the host waits for the device here
        time.sleep(args.step_time)
        if rank == 0:
            tmp = ckpt.with_name(f".ckpt.{os.getpid()}")
            tmp.write_text(json.dumps({"step": step}))
            tmp.replace(ckpt)
        phalanx.report_step(step)
        entry = {"step": step, "time": time.time(), "rank": rank, "world": world, "loss": value}
        log.write(json.dumps(entry) + "\n")
        log.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
