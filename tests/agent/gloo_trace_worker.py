"""One rank of a two-rank gloo job with the interval recorder on the CPU: both ranks all-reduce once; then
rank 1 says it is ready and never enters the second all-reduce, in which rank 0 blocks (its watcher thread
answering dump requests meanwhile) until the test ends it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx.intervals


def main() -> None:
    ready = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rec = phalanx.intervals.enable(cuda=False)
    assert rec is not None
    t = torch.ones(16)
    with phalanx.intervals.collective("all_reduce", group=dist.group.WORLD, label="dp"):
        dist.all_reduce(t)
    rec.step(0)
    if rank == 1:
        ready.write_text("ready")
        time.sleep(120)  # never enters the second all-reduce
    else:
        with phalanx.intervals.collective("all_reduce", group=dist.group.WORLD, label="dp"):
            dist.all_reduce(t)  # blocks: rank 1 never comes


if __name__ == "__main__":
    main()
