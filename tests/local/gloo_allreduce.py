"""A plain gloo script for the root-cause tests: every step all-reduces a tensor, reports the step to the
agent and pauses (all but rank 0), so a SIGKILLed rank leaves its peers waiting in an all-reduce, which
fails with gloo's "Connection closed by peer". Errors go to torch elastic's error file (``@record``), so a
peer's echo carries its own error time, earlier than the agent's observation of the kill."""

from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from phalanx import report_step


@record
def main() -> None:
    steps = int(sys.argv[1])
    # The agent stops the surviving ranks (SIGTERM, then SIGKILL after the grace period) as soon as it sees
    # the kill. On a loaded machine that SIGTERM can beat rank 0's own error out of the all-reduce, and the
    # echo these tests are about is never written. Like a script that saves on SIGTERM, this one lets its
    # error surface first; the grace period still bounds it.
    signal.signal(signal.SIGTERM, lambda *_: None)
    dist.init_process_group("gloo")
    tensor = torch.ones(1 << 14)
    pause_s = 0.1 if dist.get_rank() > 0 else 0.0
    for step in range(steps):
        dist.all_reduce(tensor)
        report_step(step)
        # Rank 0 does not pause: it waits in the next all-reduce while the others pause, so a peer killed in
        # its pause fails rank 0 there at once, before its agent (which sees the kill within its 0.1 s
        # monitor interval) stops it. Rank 0 pausing too made that a race, lost in 2 runs of 5.
        time.sleep(pause_s)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
