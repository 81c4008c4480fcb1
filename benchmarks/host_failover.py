"""What a checkpoint host that dies or hangs costs training: the agent's own watcher
(``NodeCheckpointHost``) and a training process's ``Checkpointer``, in this process, on a real host.

A loop saves a 16 MiB state every 50 ms and asks for a persist every 4th save. The host is SIGKILLed
(``kill``) or SIGSTOPped (``hang``) at a save between the 20th and the 40th (the watcher checks every
second: a fixed moment would always meet it at the same point of its cycle); reported per fault, as
medians over the runs:

* ``replaced_s``: from the signal to a new host answering on the node's socket;
* ``worst_save_s``: the longest a save (with its persist request) blocked training until then;
* ``persist_errors``: PersistErrors the loop caught until then, each naming the requests the host did not
  take since the last one (their snapshots stay in memory);
* ``committed_after_s``: from the signal to the first step persisted and committed after it.

    .venv/bin/python -m benchmarks.host_failover --runs 5 --out host_failover.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import torch  # noqa: E402

from phalanx.agent import checkpointing  # noqa: E402
from phalanx.api.errors import CheckpointError, PersistError  # noqa: E402
from phalanx.api.settings import CheckpointSettings  # noqa: E402
from phalanx.checkpoint import Checkpointer, protocol, storage  # noqa: E402

SAVE_EVERY_S = 0.05
PERSIST_EVERY = 4


def _answered_by_another(socket_path: str, old_pid: int) -> bool:
    try:
        with contextlib.closing(protocol.HostClient(socket_path, timeout_s=0.5)) as client:
            return int(client.call({"op": "ping"}, timeout_s=0.5)["pid"]) != old_pid
    except CheckpointError:
        return False


def run_once(fault: str, folder: Path, run: int, *, fault_at_save: int) -> dict[str, float]:
    said: list[str] = []
    node = checkpointing.NodeCheckpointHost(said.append)
    store = folder / f"store-{fault}-{run}"
    assert node.start(
        settings=CheckpointSettings(storage_path=str(store)),
        shm_root=Path("/dev/shm"),
        job_id=f"bench-{os.getpid()}-{fault}-{run}",
        node_id="n0",
        master_addr="",
        token_file="",
        incarnation="i",
    ), said
    env = node.env()
    os.environ.update(env)
    socket_path, old_pid = env[protocol.ENV_SOCKET], node.handle.pid
    ckpt = Checkpointer(rank=0, world_size=1, local_rank=0)
    state = {"w": torch.randn(4 << 20)}
    fault_at, replaced_at = 0.0, 0.0

    def watch() -> None:
        nonlocal replaced_at
        while not _answered_by_another(socket_path, old_pid):
            time.sleep(0.01)
        replaced_at = time.monotonic()

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        step, worst, failed, committed_at = 0, 0.0, 0, 0.0
        while not committed_at:
            step += 1
            started = time.monotonic()
            try:
                ckpt.save(step, state, persist=step % PERSIST_EVERY == 0)
            except PersistError:
                failed += 1
            took = time.monotonic() - started
            if fault_at and not replaced_at:
                worst = max(worst, took)
            if step == fault_at_save:
                fault_at = time.monotonic()
                os.kill(old_pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                watcher.start()
            if replaced_at and step % PERSIST_EVERY == 0:
                with contextlib.suppress(PersistError):  # those the host could not take, or took along
                    ckpt.wait(timeout_s=30)
                if step in storage.committed_steps(storage.open_storage(str(store))):
                    committed_at = time.monotonic()
            time.sleep(max(0.0, SAVE_EVERY_S - took))
        return {
            "replaced_s": replaced_at - fault_at,
            "worst_save_s": worst,
            "persist_errors": float(failed),
            "committed_after_s": committed_at - fault_at,
        }
    finally:
        ckpt.close()
        node.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGKILL)  # replaced, it was killed already; this only covers a failure
        for key in env:
            os.environ.pop(key, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {}
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="phalanx-host-failover-") as tmp:
        for fault in ("kill", "hang"):
            runs = [
                run_once(fault, Path(tmp), i, fault_at_save=rng.randrange(20, 40)) for i in range(args.runs)
            ]
            results[fault] = {
                **{key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]},
                "runs": runs,
            }
    doc = {
        "name": "host_failover",
        "save_every_s": SAVE_EVERY_S,
        "persist_every": PERSIST_EVERY,
        "state_bytes": 4 << 22,
        "results": results,
    }
    print(json.dumps(doc))  # one line: benchmarks/run_all.py reads the last JSON line
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
