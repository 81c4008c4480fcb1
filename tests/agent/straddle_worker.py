"""Training stand-in whose nodes straddle a step when one fails (run by phalanx local, two nodes).

First run: the ranks of rank 0's node save steps 0..11 to the flash checkpoint, the other node's ranks
steps 0..10, as if they were still copying step 11 when they were stopped (``--lead 0``: every rank saves
steps 0..10). Once every rank saved, rank 0 crashes; the other ranks wait to be stopped. A second run
(after a restart) exits 0 at once. Each node alone would persist its own newest step (11 and 10) and
nothing would be committed; the master's agreement makes both persist step 10.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

from phalanx.checkpoint import Checkpointer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--lead", type=int, default=1, help="steps rank 0's node saved beyond the other's")
    args = p.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if (d / "crashed").exists():
        return 0
    # The crashing rank's node is ahead: it must be asked to persist the older step after it chose its own.
    newest = 10 + args.lead if rank < int(os.environ["LOCAL_WORLD_SIZE"]) else 10
    ckpt = Checkpointer()
    for step in range(newest + 1):
        ckpt.save(step, {"w": torch.full((1024,), float(rank * 1000 + step)), "step": step})
    (d / f"saved-{rank}").touch()
    if rank != 0:
        time.sleep(120)  # stopped by the agent when the round breaks
        return 0
    deadline = time.monotonic() + 60
    while len(list(d.glob("saved-*"))) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    (d / "crashed").touch()
    print(f"rank 0: crashing after step {10 + args.lead}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main())
