"""A process whose formation failed can still form the next world with a freshly started peer.

Real processes and gloo over real sockets: the survivor's first world fails (its peer never comes, as when
a node vanishes while gloo connects the mesh), it leaves that world with the trainer's
:func:`phalanx.trainer.elastic.leave_world`, and then forms a world with a process that has just started,
as a replacement node's is. Without the reset of torch's group naming in ``leave_world`` the survivor
names that world "1" and the newcomer "0", and both time out waiting for each other's keys.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.trainer._procs import free_port, worker_env

FIRST_WORLD_FAILED = "first-world-failed"

SURVIVOR = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed import TCPStore
from phalanx.trainer.elastic import leave_world

lost, fresh = int(sys.argv[1]), int(sys.argv[2])
store = TCPStore("127.0.0.1", lost, 2, is_master=True, timeout=timedelta(seconds=2), wait_for_workers=False)
try:
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=2))
    sys.exit("the first world formed without its second rank")
except (RuntimeError, dist.DistError):
    print("first-world-failed", flush=True)
leave_world()
print("left the first world", file=sys.stderr, flush=True)  # where an abort happened, if one does
store = TCPStore("127.0.0.1", fresh, 2, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
print("serving the second world's store", file=sys.stderr, flush=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=20))
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item(), flush=True)
# As the Trainer ends every run (its teardown leaves the world). Left to the interpreter's exit, the second
# world's group was destroyed after the first world's leftovers and torch aborted ("terminate called without
# an active exception", SIGABRT) after the sum was printed: 1 run in 8 here, 0 in 24 with this line.
leave_world()
"""

NEWCOMER = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed import TCPStore

fresh = int(sys.argv[1])
deadline = time.monotonic() + 30
while True:  # the survivor serves this store once its first world has failed
    try:
        store = TCPStore("127.0.0.1", fresh, 2, is_master=False, timeout=timedelta(seconds=20))
        break
    except (RuntimeError, dist.DistError):
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=20))
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item())
"""


def _run_pair() -> tuple[subprocess.CompletedProcess[str], str, str]:
    lost, fresh = free_port(), free_port()
    env = worker_env()
    newcomer = subprocess.Popen(
        [sys.executable, "-c", NEWCOMER, str(fresh)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        survivor = subprocess.run(
            [sys.executable, "-c", SURVIVOR, str(lost), str(fresh)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        out, err = newcomer.communicate(timeout=30)
    finally:
        newcomer.kill()
        newcomer.wait()
    return survivor, out.decode(), err.decode()


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_survivor_of_a_failed_formation_forms_the_next_world_with_a_fresh_peer() -> None:
    survivor, out, err = _run_pair()
    if FIRST_WORLD_FAILED not in survivor.stdout and survivor.returncode < 0:
        # The set-up, not the claim: on a loaded machine torch can abort ("terminate called without an active
        # exception") inside the first world's timeout instead of raising. Once more, then it counts.
        survivor, out, err = _run_pair()
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    assert _printed(survivor.stdout) == [FIRST_WORLD_FAILED, "sum", "2.0"]
    assert _printed(out) == ["sum", "2.0"], err[-3000:]


def _printed(stdout: str) -> list[str]:
    """What the scripts printed: torch 2.9's gloo writes its own "[Gloo] Rank 0 is connected ..." lines to
    stdout too."""
    return " ".join(line for line in stdout.splitlines() if not line.startswith("[Gloo]")).split()
