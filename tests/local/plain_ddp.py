"""tests/local/hang_ddp.py as a team would have written it before phalanx: it never imports phalanx (no
recorder, no comm hook, no ``report_step``). Each step is one forward, one backward (DDP all-reduces the
gradients) and an optimizer step; rank 0 checkpoints the step (a JSON file) so a restarted round resumes;
every rank appends one JSON line per step to ``<dir>/steps-<pid>.jsonl``. What phalanx knows of it comes from
``phalanx-run``'s instrumentation (phalanx.instrument). ``--wrap fsdp2`` shards the model with FSDP2
(``fully_shard``, per layer and whole) and steps AdamW instead: the same loop as an FSDP2 script.

``--stall-at S --stall-node N`` makes local rank 0 of node N sleep before step S's backward pass, once (a
marker file remembers it): it never enters that step's all-reduce, the way a rank stuck in its data loader
or in host code would, while its peers wait in it.
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
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--stall-at", type=int, default=-1)
    p.add_argument("--stall-node", default="")
    p.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp")
    args = p.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ["PHALANX_NODE_ID"]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if args.wrap == "fsdp2":
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model: nn.Module = fully_shard(net)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        model = DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = d / "ckpt.json"
    start = json.loads(ckpt.read_text())["step"] + 1 if ckpt.exists() else 0
    log = (d / f"steps-{os.getpid()}.jsonl").open("a")
    marker = d / "stalled"
    print(f"rank {rank}/{world} on {node} starting at step {start}", flush=True)
    for step in range(start, args.steps):
        loss = model(torch.randn(8, 16)).square().mean()
        stall = step == args.stall_at and node == args.stall_node and os.environ["LOCAL_RANK"] == "0"
        if stall and not marker.exists():
            marker.write_text(str(rank))
            print(f"rank {rank} stalls before the all-reduce of step {step}", flush=True)
            time.sleep(3600)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(args.step_time)
        if rank == 0:
            tmp = ckpt.with_name(f".ckpt.{os.getpid()}")
            tmp.write_text(json.dumps({"step": step}))
            tmp.replace(ckpt)
        entry = {
            "step": step,
            "time": time.time(),
            "rank": rank,
            "world": world,
            "pid": os.getpid(),
            "node": node,
        }
        log.write(json.dumps(entry) + "\n")
        log.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
