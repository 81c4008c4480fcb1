"""One rank of the trainer-collectives recording test: the phalanx trainer's data-parallel gradient sync and
tensor-parallel all-reduce with the interval recorder on (the ring path comes from the environment)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import phalanx
import phalanx.intervals
from phalanx.trainer import comm
from phalanx.trainer.data_parallel import GradientSync


def main() -> None:
    dist.init_process_group("gloo")
    assert phalanx.intervals.enable() is not None
    model = torch.nn.Linear(4, 2)
    sync = GradientSync(model.parameters(), group=dist.group.WORLD, bucket_bytes=1)
    for step in range(3):
        sync.arm()
        model(torch.ones(3, 4)).sum().backward()
        sync.finish()
        comm.reduce_from_tensor_region(torch.ones(2), dist.group.WORLD)
        phalanx.report_step(step)
    sync.close()  # its autograd hooks hold the group: gone before the group is destroyed
    dist.destroy_process_group()
    print(json.dumps({"rank": dist.get_rank() if dist.is_initialized() else -1}))


if __name__ == "__main__":
    main()
