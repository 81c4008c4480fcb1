"""A gloo training process for the multi-rank checkpoint tests; prints one JSON line of results.

``save``: each of 2 ranks saves its own shard (tensor-parallel style); rank 1 saves one step more, so
loading must agree on the newest step both hold. ``load``: ranks load from a node without memory; with
``--replicas`` ranks r and r+2 share shard r % 2 and one of them reads it from storage. ``save-ddp``: every
rank saves the same state (data-parallel replicas) at steps 1 to 3, memory only; ``load-ddp``: a world of
another size loads it, ``--replicated`` or not; with ``--newcomer-shm-dir`` its last rank runs on a node of
its own (that memory, empty), as a replacement node does. ``save-late``: 2 ranks save steps 1 to 4 and
persist step 2, and rank 0 step 4 too (uncommitted: rank 1's shard is missing); ``load-late``: rank 0 is a
newcomer without memory and loads at once, rank 1 first persists step 4 (committing it), as an agent that
restarts its workers only once its save at breakpoint is on storage. ``corrupt-loads``: see
:func:`corrupt_loads`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.api.errors import CheckpointError
from phalanx.checkpoint import Checkpointer, storage


def shard(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def load_own_shard(ckpt: Checkpointer, rank: int) -> dict[str, object]:
    """Loads this rank's shard; where it came from, and whether it is the one saved at that step."""
    step, state = ckpt.load()  # type: ignore[misc]
    same = all(torch.equal(state["model"][k], v) for k, v in shard(rank, step).items())
    return {"step": step, "source": ckpt.last_load["source"], "ok": same}


def _rewrite_manifest(store: str, step: int, rank: int, change: Callable[[dict[str, Any]], str]) -> None:
    path = Path(store) / storage.manifest_file(step, rank)
    path.write_text(change(json.loads(path.read_text())))


def _load_from_storage(store: str, shm_dir: str, rank: int) -> dict[str, Any]:
    """Loads on a node without memory: the step and whether it is this rank's shard of it, or the error
    raised, and how long it took; then meets the other ranks (none may be left in a collective)."""
    ckpt = Checkpointer(storage=store, shm_dir=shm_dir)
    started = time.monotonic()
    got: dict[str, Any] = {}
    try:
        step, state = ckpt.load()  # type: ignore[misc]
        got.update(step=step, ok=all(torch.equal(state["model"][k], v) for k, v in shard(rank, step).items()))
    except CheckpointError as exc:
        got.update(error=type(exc).__name__, message=str(exc))
    got["seconds"] = time.monotonic() - started
    dist.barrier()
    ckpt.close()
    return got


def corrupt_loads(store: str, shm_dir: str, rank: int) -> dict[str, Any]:
    """2 ranks persist steps 1 and 2. Rank 0 then makes rank 1's manifest of step 2 malformed (a tensor's
    shape is a string), and both load from a node without memory (``first``); then it breaks step 1 too
    (a skeleton naming a tensor that does not exist in its own manifest, truncated JSON in rank 1's), and
    both load again (``second``)."""
    ckpt = Checkpointer(storage=store)
    for step in (1, 2):
        ckpt.save(step, {"model": shard(rank, step), "step": step}, persist=True)
    ckpt.wait()
    ckpt.close()
    dist.barrier()

    def bad_shape(manifest: dict[str, Any]) -> str:
        manifest["meta"]["tensors"][0]["shape"] = "64x32"
        return json.dumps(manifest)

    def bad_skeleton(manifest: dict[str, Any]) -> str:
        manifest["meta"]["skeleton"] = {"D": [[{"v": "model"}, {"T": 99}]]}
        return json.dumps(manifest)

    if rank == 0:
        _rewrite_manifest(store, 2, 1, bad_shape)
    dist.barrier()
    first = _load_from_storage(store, shm_dir, rank)
    if rank == 0:
        _rewrite_manifest(store, 1, 0, bad_skeleton)
        _rewrite_manifest(store, 1, 1, lambda manifest: json.dumps(manifest)[:40])
    dist.barrier()
    return {"first": first, "second": _load_from_storage(store, shm_dir, rank)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode",
        choices=["save", "load", "save-ddp", "load-ddp", "save-late", "load-late", "corrupt-loads"],
    )
    parser.add_argument("--storage", required=True)
    parser.add_argument("--shm-dir", default=None)
    parser.add_argument("--replicas", action="store_true")
    parser.add_argument("--replicated", action="store_true")
    parser.add_argument("--newcomer-shm-dir", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, object] = {"rank": rank}
    if args.mode == "save":
        ckpt = Checkpointer(storage=args.storage)
        for step in (1, 2, 3) if rank == 1 else (1, 2):
            ckpt.save(step, {"model": shard(rank, step), "step": step}, persist=step == 2)
        ckpt.wait()
        dist.barrier()  # every shard of step 2 is persisted before anyone loads
        result.update(load_own_shard(ckpt, rank))
        ckpt.close()
    elif args.mode == "save-late":
        ckpt = Checkpointer(storage=args.storage)
        for step in (1, 2, 3, 4):
            persist = step == 2 or (step == 4 and rank == 0)
            ckpt.save(step, {"model": shard(rank, step), "step": step}, persist=persist)
        ckpt.wait()
        ckpt.close()
    elif args.mode == "load-late":
        ckpt = Checkpointer(storage=args.storage, shm_dir=args.shm_dir if rank == 0 else None)
        if rank == 1:
            time.sleep(2.0)
            ckpt.persist(4)
            ckpt.wait()
        result.update(load_own_shard(ckpt, rank))
        ckpt.close()
    elif args.mode == "corrupt-loads":
        result.update(corrupt_loads(args.storage, args.shm_dir, rank))
    elif args.mode == "save-ddp":
        ckpt = Checkpointer(storage=args.storage)
        for step in (1, 2, 3):
            ckpt.save(step, {"model": shard(0, step), "step": step})
        ckpt.close()
    elif args.mode == "load-ddp":
        newcomer = args.newcomer_shm_dir if rank == world - 1 else None
        ckpt = Checkpointer(storage=args.storage, shm_dir=newcomer)
        loaded = ckpt.load(replicated=args.replicated)
        result.update(step=None, source=ckpt.last_load["source"], reads=ckpt.last_load["storage_reads"])
        if loaded is not None:
            step, state = loaded
            same = all(torch.equal(state["model"][k], v) for k, v in shard(0, step).items())
            result.update(step=step, ok=same)
        ckpt.close()
    else:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])] if world == 4 else []
        group = groups[rank % 2] if args.replicas and groups else None
        ckpt = Checkpointer(storage=args.storage, shm_dir=args.shm_dir)
        step, state = ckpt.load(shard_rank=rank % 2, replica_group=group)  # type: ignore[misc]
        result.update(
            step=step,
            source=ckpt.last_load["source"],
            reads=ckpt.last_load["storage_reads"],
            ok=all(torch.equal(state["model"][k], v) for k, v in shard(rank % 2, step).items()),
        )
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
