"""Flash-checkpoint benchmark: phalanx against torch.save, DCP async_save and DLRover's flash checkpoint.

Saves the same state (8 fp32 Linear layers plus their Adam state, ``--size-gb`` GiB in all) with every
method and prints one JSON object with medians of ``--repeats`` saves, then what each save costs a training
loop (:func:`in_training`). DLRover runs in a venv of its own (``--dlrover-python``; the default one is
made with uv from PyPI when missing: ``dlrover[torch]==0.6.1`` and grpcio beside this project's torch);
without it the result says why.

    python benchmarks/checkpoint.py --size-gb 1
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def build_training(
    size_bytes: int, device: str = "cpu"
) -> tuple[torch.nn.Sequential, torch.optim.Adam, dict[str, Any]]:
    """8 Linear layers and an Adam state after one step: parameters + exp_avg + exp_avg_sq = size. The
    state's tensors are the model's and the optimizer's own, so a training step changes them in place."""
    params = size_bytes // 12  # fp32 parameter + two fp32 Adam moments
    d = int(math.sqrt(params / 8))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(8)]).to(device)
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


Saver = tuple[Callable[[int], None], Callable[[], None] | None]  # save(step); fence before the update


@dataclasses.dataclass(frozen=True)
class Training:
    """The training loop of :func:`in_training`: interleaved rounds, batch, intra-op threads to try."""

    rounds: int
    batch: int
    threads: list[int]


def in_training(
    model: torch.nn.Sequential,
    opt: torch.optim.Optimizer,
    savers: dict[str, Saver],
    *,
    rounds: int,
    batch: int,
    threads: int,
) -> dict[str, Any]:
    """What a save costs a real training loop: iterations of save, forward, backward, fence, optimizer
    step, without a save and with each saver in turn, interleaved so the machine's drift hits all alike.
    The step computes on ``threads`` intra-op threads: all the cores (nothing left for a copy behind it,
    as in CPU training), or fewer (a host with cores to spare, as beside a GPU, whose step the host only
    drives). Per saver: the median iteration, the stall (that minus the median iteration without a save:
    the training time the save costs) and the median time training waited in save and fence (blocking).
    On a GPU the forward and backward only queue kernels, so a fence's wait there includes the queued
    compute: the stall, not the blocking time, is what a save behind training costs there."""
    x = torch.randn(batch, model[0].in_features, device=model[0].weight.device)
    on_device = x.is_cuda
    before = torch.get_num_threads()
    torch.set_num_threads(threads)

    def iteration(saver: Saver | None, step: int) -> tuple[float, float]:
        started = time.perf_counter()
        blocked = 0.0
        if saver is not None:
            saver[0](step)
            blocked = time.perf_counter() - started
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        if saver is not None and saver[1] is not None:
            fenced = time.perf_counter()
            saver[1]()
            blocked += time.perf_counter() - fenced
        opt.step()
        if on_device:
            torch.cuda.synchronize()  # the iteration ends when its kernels have
        return time.perf_counter() - started, blocked

    names = ["none", *savers]
    times: dict[str, list[float]] = {name: [] for name in names}
    waits: dict[str, list[float]] = {name: [] for name in names}
    step = 1000
    try:
        for r in range(rounds + 1):
            for name in names:
                step += 1
                took, blocked = iteration(savers.get(name), step)
                if r:  # the first round warms up
                    times[name].append(took)
                    waits[name].append(blocked)
    finally:
        torch.set_num_threads(before)
    base = statistics.median(times["none"])
    out: dict[str, Any] = {
        "batch": batch,
        "rounds": rounds,
        "threads": threads,
        "iteration_without_save_s": base,
    }
    for name in savers:
        median = statistics.median(times[name])
        out[name] = {
            "iteration_s": median,
            "stall_s": median - base,
            "blocking_s": statistics.median(waits[name]),
        }
    return out


def training_step(
    model: torch.nn.Sequential, opt: torch.optim.Optimizer, *, batch: int
) -> Callable[[], None]:
    """One iteration of :func:`in_training`'s loop without a save, on torch's current threads."""
    x = torch.randn(batch, model[0].in_features, device=model[0].weight.device)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
        if x.is_cuda:
            torch.cuda.synchronize()

    return step


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in tensors_of(v)]
    return []


def nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def median_of(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memcpy_limit(state: Any, repeats: int) -> dict[str, float]:
    """Copying the tensors into already-touched memory: the floor for any in-memory save. The limit is the
    faster one-thread copy of the C library's memcpy (glibc uses non-temporal stores for large blocks) and
    torch's copy_."""
    tensors = tensors_of(state)
    dst = [torch.empty_like(t) for t in tensors]
    for d in dst:
        d.fill_(0)  # touch every page

    def copy() -> None:
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)

    def memcpy() -> None:
        for d, t in zip(dst, tensors, strict=True):
            ctypes.memmove(d.data_ptr(), t.data_ptr(), t.numel() * t.element_size())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    one = median_of(copy, repeats)
    torch.set_num_threads(threads)
    many = median_of(copy, repeats)
    libc_one = median_of(memcpy, repeats)
    fresh_started = time.perf_counter()
    fresh = [torch.empty_like(t) for t in tensors]
    for d, t in zip(fresh, tensors, strict=True):
        d.copy_(t)
    fresh_s = time.perf_counter() - fresh_started
    return {
        "memcpy_one_thread_s": libc_one,
        "torch_copy_one_thread_s": one,
        f"torch_copy_{threads}_threads_s": many,
        "fresh_memory_s": fresh_s,
    }


def d2h_limit(state: Any, repeats: int) -> dict[str, float]:
    """Copying the device tensors into pinned host memory (the floor for a save from a GPU), and into
    ordinary host memory for comparison."""
    tensors = tensors_of(state)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    pageable = [torch.empty(t.shape, dtype=t.dtype).fill_(0) for t in tensors]

    def copy(into: list[torch.Tensor]) -> None:
        for d, t in zip(into, tensors, strict=True):
            d.copy_(t, non_blocking=True)
        torch.cuda.synchronize()

    copy(pinned)  # warm up
    return {
        "d2h_pinned_s": median_of(lambda: copy(pinned), repeats),
        "d2h_pageable_s": median_of(lambda: copy(pageable), repeats),
    }


def bench_phalanx(
    state: Any,
    repeats: int,
    workdir: Path,
    *,
    first_runs: int,
    train_step: Callable[[], None],
    storage: str = "",
    first_steps: int = 3,
) -> dict[str, Any]:
    """phalanx's saves, persists and loads; ``storage``: where to persist (default: a directory in
    ``workdir``; e.g. ``s3://bucket/prefix`` with the AWS_* variables set), one location per job.
    ``train_step``: one training iteration that updates ``state`` (for
    :func:`first_saves_of_an_incarnation`)."""
    from phalanx.checkpoint import Checkpointer
    from phalanx.checkpoint import host as host_mod
    from phalanx.checkpoint.storage import open_storage

    results: dict[str, Any] = {}
    # How the first save of a new process finds its memory: "unprepared" (saved at once after the
    # construction, before any optimizer step: the worst case), "optimizer" (no prepare(): ``first_steps``
    # training steps first, the Checkpointer readying its slots from the optimizer's state at the second, as
    # in a plain script), "prepared" (prepare(state) and wait_prepared() first).
    modes = ("unprepared", "optimizer", "prepared")
    firsts: dict[str, list[float]] = {m: [] for m in modes}
    beside: dict[str, list[float]] = {m: [] for m in modes}
    # A first save happens once per job: its median needs a fresh job (host, memory) per sample. The last
    # prepared job goes on to the steady-state saves, persistence and loads.
    for mode in [m for m in modes for _ in range(first_runs)]:
        job = f"bench-{uuid.uuid4().hex[:8]}"
        store = f"{storage.rstrip('/')}/{job}" if storage else str(workdir / f"phalanx-{job}")
        handle = host_mod.start(job_id=job, storage=store, socket_path=workdir / f"{job}.sock")
        try:
            ckpt = Checkpointer(
                job_id=job, storage=store, host_socket=str(handle.socket_path), rank=0, world_size=1
            )
            if mode == "prepared":
                ckpt.prepare(state)  # what a training script does once its state exists
                ckpt.wait_prepared()
            elif mode == "optimizer":
                for _ in range(first_steps):
                    train_step()
            started = time.perf_counter()
            ckpt.save(1, state)
            firsts[mode].append(time.perf_counter() - started)
            # A steady save right after, on the same loaded or quiet machine: each first save's ratio to it.
            ckpt.wait_prepared()
            started = time.perf_counter()
            ckpt.save(2, state)
            beside[mode].append(time.perf_counter() - started)
            if len(firsts[mode]) < first_runs:
                ckpt.close()
                continue
            if mode != "prepared":
                key = "first_unprepared" if mode == "unprepared" else "first_from_optimizer"
                results[f"{key}_blocking_s"] = statistics.median(firsts[mode])
                results[f"{key}_samples_s"] = firsts[mode]
                results[f"{key}_steady_beside_s"] = beside[mode]
                results[f"{key}_ratio_median"] = ratio_median(firsts[mode], beside[mode])
                if mode == "optimizer":
                    results["first_from_optimizer_after_steps"] = first_steps
                ckpt.close()
                continue
            results["first_blocking_s"] = statistics.median(firsts["prepared"])
            results["first_samples_s"] = firsts["prepared"]
            results["first_steady_beside_s"] = beside["prepared"]
            results["first_ratio_median"] = ratio_median(firsts["prepared"], beside["prepared"])
            steps = itertools.count(3)
            saves = []
            for _ in range(max(repeats, 5)):
                started = time.perf_counter()
                ckpt.save(next(steps), state)
                saves.append(time.perf_counter() - started)
            results["blocking_s"] = statistics.median(saves)
            persists, persist_blocking = [], []
            for _ in range(3):
                step = next(steps)
                started = time.perf_counter()
                ckpt.save(step, state, persist=True)
                persist_blocking.append(time.perf_counter() - started)
                ckpt.wait()
                persists.append(time.perf_counter() - started)
            results["persist_s"] = statistics.median(persists)
            results["persist_blocking_s"] = statistics.median(persist_blocking)
            started = time.perf_counter()
            ckpt.load()
            results["load_from_memory_s"] = time.perf_counter() - started
            started = time.perf_counter()
            ckpt.load(into=state)  # a restarted process whose model and optimizer exist already
            results["load_from_memory_in_place_s"] = time.perf_counter() - started
            ckpt.close()
            results.update(
                first_saves_of_an_incarnation(job, store, handle, state, steps, first_runs, train_step)
            )
        finally:
            handle.stop()
            open_storage(store).remove_dir("")
    return results


def ratio_median(firsts: list[float], steadies: list[float]) -> float:
    """The median over samples of a first save's time over the steady save right after it."""
    return statistics.median(f / s for f, s in zip(firsts, steadies, strict=True))


def first_saves_of_an_incarnation(
    job: str,
    store: str,
    handle: Any,
    state: Any,
    steps: Any,
    runs: int,
    train_step: Callable[[], None],
) -> dict[str, Any]:
    """The first save of a new incarnation, whose sizes are known before it: a restarted process (the host
    kept its slots: mapped from the Checkpointer's construction on) and a replacement node (its memory is
    gone: the load from storage readies the slots). Each first save comes as in a training script: after the
    load and one training step (whose time, beside the background work, is reported next to a plain step's),
    and also at once after the construction or the load (the worst case: nothing had time to run). Each
    first save after a step is followed by a steady save of the same process: their ratio is taken per
    sample, so that a machine whose load drifts during the run skews both alike."""
    from phalanx.checkpoint import Checkpointer
    from phalanx.checkpoint import host as host_mod

    def timed(fn: Callable[[], Any]) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    plain_step = statistics.median(timed(train_step) for _ in range(3))
    out: dict[str, Any] = {"train_step_s": plain_step}
    at_once, restarted, restarted_steps, restarted_beside = [], [], [], []
    for _ in range(runs):
        again = Checkpointer(
            job_id=job, storage=store, host_socket=str(handle.socket_path), rank=0, world_size=1
        )
        at_once.append(timed(lambda again=again: again.save(next(steps), state)))
        again.close()
        again = Checkpointer(
            job_id=job, storage=store, host_socket=str(handle.socket_path), rank=0, world_size=1
        )
        again.load(into=state)  # a restarted script loads its snapshot in place, then trains
        restarted_steps.append(timed(train_step))
        restarted.append(timed(lambda again=again: again.save(next(steps), state)))
        again.wait_prepared()
        restarted_beside.append(timed(lambda again=again: again.save(next(steps), state)))
        again.close()
    out["first_restarted_blocking_s"] = statistics.median(restarted)
    out["first_restarted_samples_s"] = restarted
    out["first_restarted_step_s"] = statistics.median(restarted_steps)
    out["first_restarted_steady_beside_s"] = restarted_beside
    out["first_restarted_ratio_median"] = ratio_median(restarted, restarted_beside)
    out["first_restarted_at_once_blocking_s"] = statistics.median(at_once)
    out["first_restarted_at_once_samples_s"] = at_once
    loads, replaced, replaced_at_once, replaced_steps, replaced_beside = [], [], [], [], []
    for sample in range(2 * runs):
        handle.stop()  # the node goes, with its memory: a new one loads the newest step from storage
        handle = host_mod.start(job_id=job, storage=store, socket_path=handle.socket_path)
        fresh = Checkpointer(
            job_id=job, storage=store, host_socket=str(handle.socket_path), rank=0, world_size=1
        )
        loads.append(timed(lambda fresh=fresh: fresh.load(into=state)))
        assert fresh.last_load["source"] == "storage", fresh.last_load
        if sample % 2:  # every other node saves at once after its load, the others after a training step
            replaced_at_once.append(timed(lambda fresh=fresh: fresh.save(next(steps), state)))
        else:
            replaced_steps.append(timed(train_step))
            replaced.append(timed(lambda fresh=fresh: fresh.save(next(steps), state)))
            fresh.wait_prepared()
            replaced_beside.append(timed(lambda fresh=fresh: fresh.save(next(steps), state)))
        fresh.close()
    out["load_from_storage_s"] = statistics.median(loads)
    out["first_after_storage_load_blocking_s"] = statistics.median(replaced)
    out["first_after_storage_load_samples_s"] = replaced
    out["first_after_storage_load_step_s"] = statistics.median(replaced_steps)
    out["first_after_storage_load_steady_beside_s"] = replaced_beside
    out["first_after_storage_load_ratio_median"] = ratio_median(replaced, replaced_beside)
    out["first_after_storage_load_at_once_blocking_s"] = statistics.median(replaced_at_once)
    out["first_after_storage_load_at_once_samples_s"] = replaced_at_once
    handle.stop()
    return out


def bench_phalanx_training(
    model: torch.nn.Sequential,
    opt: torch.optim.Optimizer,
    state: Any,
    workdir: Path,
    *,
    rounds: int,
    batch: int,
    threads: list[int],
) -> dict[str, Any]:
    """:func:`in_training` with phalanx's blocking save and its save behind the next step, for each of
    ``threads``."""
    from phalanx.checkpoint import Checkpointer
    from phalanx.checkpoint import host as host_mod

    job = f"bench-{uuid.uuid4().hex[:8]}"
    handle = host_mod.start(job_id=job, socket_path=workdir / f"{job}.sock")
    try:
        ckpt = Checkpointer(job_id=job, host_socket=str(handle.socket_path), rank=0, world_size=1)
        ckpt.prepare(state)
        ckpt.wait_prepared()
        result: dict[str, Any] = {}
        for count in threads:
            behind: list[float] = []  # the share of each save the background copied before the fence

            def fence(behind: list[float] = behind) -> None:
                ckpt.fence()
                behind.append(ckpt.last_save["behind_bytes"] / max(1, nbytes(state)))

            savers: dict[str, Saver] = {
                "phalanx": (lambda step: ckpt.save(step, state), None),
                "phalanx_behind": (lambda step: ckpt.save(step, state, blocking=False), fence),
            }
            one = in_training(model, opt, savers, rounds=rounds, batch=batch, threads=count)
            if not any(t.is_cuda for t in tensors_of(state)):  # a GPU's copy runs on a side stream
                one["phalanx_behind"]["copied_behind_training"] = statistics.median(behind)
            result[f"threads_{count}"] = one
        ckpt.close()
        return result
    finally:
        handle.stop()


def bench_torch_save(state: Any, repeats: int, directory: Path) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"bench-{uuid.uuid4().hex[:8]}.pt"
    try:
        first_started = time.perf_counter()
        torch.save(state, path)
        first = time.perf_counter() - first_started
        return {"first_blocking_s": first, "blocking_s": median_of(lambda: torch.save(state, path), repeats)}
    finally:
        path.unlink(missing_ok=True)


def bench_dcp(state: Any, repeats: int, workdir: Path) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{workdir}/dcp-store", rank=0, world_size=1)
    blocking, total = [], []
    for i in range(repeats):
        target = workdir / f"dcp-{i}"
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(target))
        blocking.append(time.perf_counter() - started)
        future.result()
        total.append(time.perf_counter() - started)
        shutil.rmtree(target, ignore_errors=True)
    dist.destroy_process_group()
    return {
        "first_blocking_s": blocking[0],
        "blocking_s": statistics.median(blocking),
        "total_s": statistics.median(total),
    }


DLROVER_SCRIPT = r"""
import json, os, shutil, statistics, sys, time
import torch, torch.distributed as dist
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
sys.path.insert(0, os.path.dirname(os.environ["BENCH_PHALANX_SRC"]))
from benchmarks.checkpoint import build_training, in_training
size, repeats, workdir, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{workdir}/dl-store", rank=0, world_size=1)
model, opt, state = build_training(size, device)
ckpt = DdpCheckpointer(os.path.join(workdir, "dlrover-ckpt"))
ours = None
if os.environ.get("BENCH_PHALANX_SRC"):  # phalanx in the same process, saves interleaved with DLRover's
    sys.path.insert(0, os.environ["BENCH_PHALANX_SRC"])
    os.environ["PYTHONPATH"] = os.environ["BENCH_PHALANX_SRC"]  # for the host process
    from phalanx.checkpoint import Checkpointer
    from phalanx.checkpoint import host as host_mod
    job = f"bench-dl-{os.getpid()}"
    handle = host_mod.start(job_id=job, socket_path=os.path.join(workdir, "dl-ph.sock"))
    ours = Checkpointer(job_id=job, host_socket=str(handle.socket_path), rank=0, world_size=1)
    ours.prepare(state)
    ours.wait_prepared()
times, mine = [], []
for step in range(1, repeats + 2):
    t = time.perf_counter()
    ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
    times.append(time.perf_counter() - t)
    if ours is not None:
        t = time.perf_counter()
        ours.save(step, state)
        mine.append(time.perf_counter() - t)
train_rounds = int(os.environ.get("BENCH_TRAIN_ROUNDS", "0"))
if ours is not None and train_rounds:
    savers = {
        "dlrover": (lambda s: ckpt.save_checkpoint(s, state, storage_type=StorageType.MEMORY), None),
        "phalanx": (lambda s: ours.save(s, state), None),
        "phalanx_behind": (lambda s: ours.save(s, state, blocking=False), ours.fence),
    }
    batch = int(os.environ["BENCH_TRAIN_BATCH"])
    in_train = {
        f"threads_{count}": in_training(model, opt, savers, rounds=train_rounds, batch=batch, threads=count)
        for count in json.loads(os.environ["BENCH_TRAIN_THREADS"])
    }
t = time.perf_counter()
path = os.path.join(workdir, "dlrover-ckpt", "x.pt")
ckpt.save_checkpoint(repeats + 2, state, path, storage_type=StorageType.DISK)
disk_blocking = time.perf_counter() - t
result = {"first_blocking_s": times[0], "blocking_s": statistics.median(times[1:])}
result["disk_blocking_s"] = disk_blocking
if ours is not None:
    result["phalanx_interleaved"] = {"first_blocking_s": mine[0], "blocking_s": statistics.median(mine[1:])}
    if train_rounds:
        result["in_training"] = in_train
    ours.close()
    handle.stop()
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
"""


DLROVER_SOCKETS = "/tmp/ckpt_sock"  # DLRover's fixed socket directory (dlrover.python.common.multi_process)


DLROVER_VENV = Path("/tmp/dlrover-venv")
DLROVER_REQUIREMENTS = [
    "dlrover[torch]==0.6.1",
    "grpcio",
    f"torch=={torch.__version__.split('+')[0]}",
    "numpy",
]


def make_dlrover_venv(venv: Path) -> str:
    """Makes ``venv`` with DLRover and this project's torch (uv, beside this interpreter); "" or why not."""
    uv = Path(sys.executable).with_name("uv")
    commands = [
        [str(uv), "venv", "-q", "-p", sys.executable, str(venv)],
        [str(uv), "pip", "install", "-q", "-p", str(venv / "bin" / "python"), *DLROVER_REQUIREMENTS],
    ]
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            return f"{' '.join(command[:3])} failed: {done.stderr.strip()[-300:]}"
    return ""


def bench_dlrover(
    python: str, size: int, repeats: int, workdir: Path, *, first_runs: int, train: Training, device: str
) -> dict[str, Any]:
    """DLRover's flash checkpoint, ``first_runs`` fresh processes (its first save happens once per process):
    the medians of their first saves and of their steady-state medians, phalanx's interleaved saves alike.
    The first process also trains (see :func:`in_training`) with DLRover's, phalanx's and phalanx's
    overlapped saves interleaved."""
    default = Path(python) == DLROVER_VENV / "bin" / "python"
    if default and not Path(python).exists() and (why := make_dlrover_venv(DLROVER_VENV)):
        return {"error": f"cannot make DLRover's venv: {why}"}
    if not Path(python).exists():
        return {"error": f"no DLRover environment at {python} (pip install 'dlrover[torch]==0.6.1' there)"}
    runs = [
        _dlrover_once(python, size, repeats, workdir, train=train if i == 0 else None, device=device)
        for i in range(first_runs)
    ]
    failed = [r["error"] for r in runs if "error" in r]
    if failed:
        return {"error": failed[0], "failed_runs": len(failed)}

    def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "first_blocking_s": statistics.median(r["first_blocking_s"] for r in rows),
            "blocking_s": statistics.median(r["blocking_s"] for r in rows),
            "first_samples_s": [r["first_blocking_s"] for r in rows],
        }

    return {
        **medians(runs),
        "disk_blocking_s": statistics.median(r["disk_blocking_s"] for r in runs),
        "phalanx_interleaved": medians([r["phalanx_interleaved"] for r in runs]),
        "runs": first_runs,
        "in_training": runs[0].get("in_training", {}),
    }


def _dlrover_once(
    python: str, size: int, repeats: int, workdir: Path, *, train: Training | None, device: str
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["BENCH_PHALANX_SRC"] = str(Path(__file__).resolve().parents[1] / "src")
    if train is not None:
        env["BENCH_TRAIN_ROUNDS"], env["BENCH_TRAIN_BATCH"] = str(train.rounds), str(train.batch)
        env["BENCH_TRAIN_THREADS"] = json.dumps(train.threads)
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", NODE_RANK="0", GROUP_RANK="0")
    shutil.rmtree(DLROVER_SOCKETS, ignore_errors=True)  # stale sockets of an earlier, killed run
    before = set(os.listdir("/dev/shm"))
    log = (workdir / "dlrover.log").open("w")
    proc = subprocess.Popen(
        [python, "-c", DLROVER_SCRIPT, str(size), str(repeats), str(workdir), device],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,  # DLRover's saver process outlives the script; the group is killed below
    )
    assert proc.stdout is not None
    result: dict[str, Any] = {}
    deadline = time.monotonic() + 600
    try:
        for line in proc.stdout:  # DLRover's saver keeps the process alive after the script ends
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
                break
            if time.monotonic() > deadline:
                result = {"error": "DLRover did not finish within 600 s"}
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        log.close()
        if not result:
            tail = [line for line in (workdir / "dlrover.log").read_text().splitlines() if "INFO" not in line]
            result = {"error": f"DLRover exited {proc.returncode} without a result: {tail[-3:]}"}
        shutil.rmtree(DLROVER_SOCKETS, ignore_errors=True)
        for name in set(os.listdir("/dev/shm")) - before:  # DLRover's segments (ckpt_shm_*)
            path = Path("/dev/shm") / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--first-runs", type=int, default=5, help="fresh jobs for the medians of first saves")
    parser.add_argument(
        "--first-steps",
        type=int,
        default=3,
        help="training steps before the first save of a script that never calls prepare() (its memory is "
        "readied from the optimizer at the second)",
    )
    parser.add_argument("--workdir", default="")
    parser.add_argument(
        "--storage", default="", help="where phalanx persists, e.g. s3://bucket/prefix (default: the workdir)"
    )
    parser.add_argument("--dlrover-python", default=str(DLROVER_VENV / "bin" / "python"))
    parser.add_argument(
        "--only", default="", help="comma-separated subset: memcpy,phalanx,training,disk,shm,dcp,dlrover"
    )
    parser.add_argument(
        "--train-rounds", type=int, default=10, help="interleaved rounds of the training loop"
    )
    parser.add_argument(
        "--train-batch",
        type=int,
        default=0,
        help="batch of the training loop's steps (default: 16 on CPU; 4096 on a GPU, where a step of a few "
        "hundred ms is what a state of this size trains at, not the 10 ms of batch 16)",
    )
    parser.add_argument(
        "--train-threads",
        default="",
        help="comma-separated intra-op threads of the training step (default: all cores, then one fewer)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model and its state live (cuda: saves copy device to host; the limit is pinned D2H)",
    )
    args = parser.parse_args()
    cores = torch.get_num_threads()
    # Beside a GPU the host only drives the step: one thread count says it all.
    default_threads = [cores] if args.device == "cuda" else sorted({cores, max(1, cores - 1)}, reverse=True)
    train = Training(
        rounds=args.train_rounds,
        batch=args.train_batch or (4096 if args.device == "cuda" else 16),
        threads=[int(t) for t in args.train_threads.split(",")] if args.train_threads else default_threads,
    )
    sections = {"memcpy", "phalanx", "training", "disk", "shm", "dcp", "dlrover"}
    only = set(args.only.split(",")) if args.only else sections
    size = int(args.size_gb * (1 << 30))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="phalanx-bench-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    model, opt, state = build_training(size, args.device)
    out: dict[str, Any] = {
        "name": "checkpoint",
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "size_bytes": nbytes(state),
        "torch_threads": torch.get_num_threads(),
    }
    results: dict[str, Any] = {}
    try:
        if "memcpy" in only and args.device == "cuda":
            limits = d2h_limit(state, args.repeats)
            out["d2h_limit_s"] = limits["d2h_pinned_s"]
            out["d2h"] = limits
        elif "memcpy" in only:
            limits = memcpy_limit(state, args.repeats)
            out["memcpy_limit_s"] = min(limits["memcpy_one_thread_s"], limits["torch_copy_one_thread_s"])
            out["memcpy"] = limits
        if "phalanx" in only:
            results["phalanx"] = bench_phalanx(
                state,
                args.repeats,
                workdir,
                first_runs=args.first_runs,
                train_step=training_step(model, opt, batch=train.batch),
                storage=args.storage,
                first_steps=args.first_steps,
            )
        if "training" in only:
            results["phalanx"] = {
                **results.get("phalanx", {}),
                "in_training": bench_phalanx_training(
                    model, opt, state, workdir, rounds=train.rounds, batch=train.batch, threads=train.threads
                ),
            }
        if "disk" in only:
            results["torch_save_disk"] = bench_torch_save(state, args.repeats, workdir / "disk")
        if "shm" in only:
            results["torch_save_shm"] = bench_torch_save(state, args.repeats, Path("/dev/shm") / workdir.name)
        if "dcp" in only:
            results["dcp_async"] = bench_dcp(state, args.repeats, workdir)
        if "dlrover" in only:
            results["dlrover"] = bench_dlrover(
                args.dlrover_python,
                size,
                args.repeats,
                workdir,
                first_runs=args.first_runs,
                train=train,
                device=args.device,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / workdir.name, ignore_errors=True)
    out["results"] = results
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
