"""A one-rank NCCL job with the interval recorder on a GPU: one recorded all-reduce, then it waits (its
watcher thread answering dump requests) until the test says it may leave."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx.intervals


def main() -> None:
    ready, leave = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    rec = phalanx.intervals.enable(cuda=True)
    assert rec is not None
    t = torch.ones(1024, device="cuda")
    with phalanx.intervals.collective("all_reduce", group=dist.group.WORLD, label="dp"):
        dist.all_reduce(t)
    rec.step(0)
    torch.cuda.synchronize()
    ready.write_text("ready")
    deadline = time.monotonic() + 60
    while not leave.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
