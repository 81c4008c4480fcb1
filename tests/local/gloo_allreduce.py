"""A plain gloo script for the root-cause tests: every step all-reduces a tensor, reports the step to the
agent and pauses, so a SIGKILLed rank leaves its peers waiting in (or about to enter) an all-reduce, which
fails with gloo's "Connection closed by peer". Errors go to torch elastic's error file (``@record``), so a
peer's echo carries its own error time, earlier than the agent's observation of the kill."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from phalanx import report_step


@record
def main() -> None:
    steps = int(sys.argv[1])
    dist.init_process_group("gloo")
    tensor = torch.ones(1 << 14)
    for step in range(steps):
        dist.all_reduce(tensor)
        report_step(step)
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
