"""One rank of a two-rank gloo job: an unmodified training loop (two all-reduces and an SGD step a step)
under phalanx-run's instrumentation (``phalanx.instrument``, as the worker bootstrap installs it). After
``steps`` steps rank 1 stops entering collectives (it sleeps, as a rank stuck in its data loader would) and
rank 0 blocks in one more all-reduce; before it does, rank 0 writes the sequence number c10d gives that
all-reduce to ``<ready>-0``, and rank 1 writes ``<ready>-1`` when it stops."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from phalanx import instrument


def main() -> None:
    ready, steps = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["RANK"])
    assert instrument.install()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # type: ignore[arg-type]
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
    if rank == 1:
        Path(f"{ready}-1").write_text("stopped")
        time.sleep(120)
    else:
        seq = dist.group.WORLD._get_sequence_number_for_group() + 1  # type: ignore[union-attr]
        Path(f"{ready}-0").write_text(str(seq))
        dist.all_reduce(torch.ones(3))  # blocks: rank 1 never comes


if __name__ == "__main__":
    main()
