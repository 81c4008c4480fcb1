"""DCP over the flash checkpoint: what a save blocks training for, ``FlashWriter`` against DCP's own async
save to disk.

Saves the same CPU state (8 fp32 Linear layers and their Adam state, ``--size-mb`` MiB in all, built as
benchmarks/checkpoint.py builds it) from one gloo process, the methods interleaved round by round so the
machine's drift hits them alike; the first round is reported apart (``first_blocking_s``: a first save also
allocates its memory):

- ``flash_async``: ``dcp.async_save(state, storage_writer=FlashWriter(step=s))``: FlashWriter stages into the
  flash checkpoint's shared memory, so the call blocks for that copy; DCP's planning runs behind.
- ``flash_async_persist``: the same with ``persist=True``; ``total_s`` runs until the node's checkpoint host
  has the step on disk (``checkpointer().wait()``).
- ``flash_sync``: ``dcp.save(state, storage_writer=FlashWriter(step=s))``: DCP's planning, then the copy.
- ``fs_async``: ``dcp.async_save(state, storage_writer=FileSystemWriter(dir))``, DCP's default: it stages
  into freshly allocated CPU memory, then writes the files behind (``total_s``: until they are written).
- ``fs_async_kept_stager``: the same with one ``DefaultStager`` kept for every save (``async_save`` makes and
  closes one per call), which may reuse its staging memory. (``FileSystemWriter(cache_staged_state_dict=
  True)`` keeps pinned staging memory, which needs CUDA.)

Two references run in the same rounds: ``copy_floor``, a copy of the tensors into memory allocated and
touched before (what any staging costs at least), and ``checkpointer_save``, the flash checkpoint without DCP
(``Checkpointer.save`` of the same state).

Per method: the median time the call blocked (``blocking_s``, and its minimum: on a loaded machine the
least disturbed sample) and until the save was complete (``total_s``).
Then loads into the same state: ``dcp.load`` through ``FlashReader`` (from memory) and ``FileSystemReader``
(the files just written; the page cache holds them). Prints one JSON object on its last line.

    python benchmarks/dcp.py --size-mb 256 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.checkpoint import build_training, nbytes

Save = Callable[[int], tuple[float, float]]  # save(step) -> (seconds blocked, seconds until complete)


def flash_async(ckpt: Any, state: Any, *, persist: bool = False) -> Save:
    from phalanx.checkpoint.dcp import FlashWriter

    def save(step: int) -> tuple[float, float]:
        started = time.perf_counter()
        done = dcp.async_save(
            state, storage_writer=FlashWriter(step=step, persist=persist, checkpointer=ckpt)
        )
        blocked = time.perf_counter() - started
        done.result()  # type: ignore[union-attr]
        if persist:
            ckpt.wait()
        return blocked, time.perf_counter() - started

    return save


def flash_sync(ckpt: Any, state: Any) -> Save:
    from phalanx.checkpoint.dcp import FlashWriter

    def save(step: int) -> tuple[float, float]:
        started = time.perf_counter()
        dcp.save(state, storage_writer=FlashWriter(step=step, checkpointer=ckpt))
        took = time.perf_counter() - started
        return took, took

    return save


def fs_async(state: Any, directory: Path, *, kept_stager: bool) -> Save:
    """DCP's async save to files; with ``kept_stager`` one DefaultStager serves every save (async_save makes
    and closes one per call), so that it may reuse its staging memory."""
    stager = DefaultStager(StagingOptions(False, False, False, False)) if kept_stager else None

    def save(step: int) -> tuple[float, float]:
        target = directory / f"step-{step}"
        started = time.perf_counter()
        done = dcp.async_save(state, storage_writer=FileSystemWriter(target), async_stager=stager)
        blocked = time.perf_counter() - started
        done.result()  # type: ignore[union-attr]
        took = time.perf_counter() - started
        shutil.rmtree(target, ignore_errors=True)
        return blocked, took

    return save


def copy_floor(state: Any) -> Save:
    """A copy of every tensor into memory allocated and touched before: what any staging costs at least."""
    sources = _tensors(state)
    targets = [torch.empty_like(t).copy_(t) for t in sources]

    def save(step: int) -> tuple[float, float]:
        started = time.perf_counter()
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)
        took = time.perf_counter() - started
        return took, took

    return save


def checkpointer_save(ckpt: Any, state: Any) -> Save:
    """The flash checkpoint without DCP: ``Checkpointer.save`` of the same state."""

    def save(step: int) -> tuple[float, float]:
        started = time.perf_counter()
        ckpt.save(step, state)
        took = time.perf_counter() - started
        return took, took

    return save


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


def interleaved(saves: dict[str, Save], rounds: int) -> dict[str, dict[str, Any]]:
    """Every method once per round, in turn; round 0 is the first save of each."""
    blocked: dict[str, list[float]] = {name: [] for name in saves}
    total: dict[str, list[float]] = {name: [] for name in saves}
    step = 0
    for _ in range(rounds + 1):
        for name, save in saves.items():
            step += 1
            b, t = save(step)
            blocked[name].append(b)
            total[name].append(t)
    return {
        name: {
            "first_blocking_s": blocked[name][0],
            "blocking_s": statistics.median(blocked[name][1:]),
            "min_blocking_s": min(blocked[name][1:]),
            "total_s": statistics.median(total[name][1:]),
            "blocking_samples_s": blocked[name][1:],
        }
        for name in saves
    }


def loads(ckpt: Any, state: Any, directory: Path, repeats: int) -> dict[str, float]:
    from phalanx.checkpoint.dcp import FlashReader

    def timed(load: Callable[[], None]) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            load()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    files = directory / "loaded"
    dcp.save(state, storage_writer=FileSystemWriter(files))
    return {
        "flash_memory_s": timed(lambda: dcp.load(state, storage_reader=FlashReader(checkpointer=ckpt))),
        "fs_page_cache_s": timed(lambda: dcp.load(state, storage_reader=FileSystemReader(files))),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7, help="rounds after the first, for the medians")
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()

    from phalanx.checkpoint import Checkpointer
    from phalanx.checkpoint import host as host_mod

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="phalanx-bench-dcp-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/pg-store", rank=0, world_size=1)
    _, _, state = build_training(args.size_mb << 20)
    job = f"bench-dcp-{uuid.uuid4().hex[:8]}"
    store = workdir / "flash-store"
    handle = host_mod.start(job_id=job, storage=str(store), socket_path=workdir / f"{job}.sock")
    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {
        "name": "dcp",
        "machine": f"{cores} cores, no GPU, load average {load:.1f} at the start",
        "device": "cpu",
        "size_bytes": nbytes(state),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_before": load,
    }
    try:
        ckpt = Checkpointer(
            job_id=job, storage=str(store), host_socket=str(handle.socket_path), rank=0, world_size=1
        )
        saves = {
            "copy_floor": copy_floor(state),
            "checkpointer_save": checkpointer_save(ckpt, state),
            "flash_async": flash_async(ckpt, state),
            "flash_async_persist": flash_async(ckpt, state, persist=True),
            "flash_sync": flash_sync(ckpt, state),
            "fs_async": fs_async(state, workdir / "fs", kept_stager=False),
            "fs_async_kept_stager": fs_async(state, workdir / "fs", kept_stager=True),
        }
        out["results"] = interleaved(saves, args.repeats)
        out["loads"] = loads(ckpt, state, workdir / "fs", repeats=3)
        ckpt.close()
    finally:
        handle.stop()
        dist.destroy_process_group()
        shutil.rmtree(workdir, ignore_errors=True)
    out["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
