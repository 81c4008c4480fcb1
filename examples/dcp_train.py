"""A torchrun-style FSDP2 training script (gloo, CPU) that checkpoints with ``torch.distributed.checkpoint``
through phalanx's flash checkpoint: one argument to ``dcp.save`` / ``dcp.load`` each.

Every step is saved with ``dcp.save(state, storage_writer=FlashWriter(step=step, persist=...))`` (with
``--async-save``, ``dcp.async_save`` on a gloo group of its own, which returns once the state is in shared
memory): each rank's shards go into its node agent's shared memory, persisted every ``--persist-every``
steps in the background when the agent has a checkpoint directory. At start, ``FlashReader`` finds the newest
step all ranks hold, from memory when the node kept it, else from storage, and ``dcp.load`` restores the
sharded model and Adam state from it. Each rank prints where it loaded from: ``dcp: loaded step S from
memory (storage reads 0)``. The batches depend on the step only, so a resumed run trains exactly as one that
never stopped.

With ``--digest-dir`` each rank appends a JSON line per event to ``rank<N>.jsonl`` there: ``{"step",
"digest", "restart"}`` before each save (so that a rank killed between the two has logged every step it may
be restored to) and ``{"loaded", "source", "storage_reads", "digest", "restart"}`` after a load, where
``digest`` is a sha256 of the rank's local shards of the model and optimizer state: a load restored a step
bitwise when its digest is the one logged when that step was saved. With ``--unbroken-digest`` the last
incarnation then trains a fresh model through every step in one go, without checkpoints, and logs
``{"unbroken": digest, "restart"}``: a run resumed from a checkpoint must end in that state.

    phalanx local --nodes 1 --nproc-per-node 2 --agent-arg=--checkpoint-dir=/tmp/ckpt \\
        --inject kill-worker@step=20,node=0,rank=1 -- examples/dcp_train.py --steps 40
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from phalanx import report_step
from phalanx.checkpoint import PersistError
from phalanx.checkpoint.dcp import FlashReader, FlashWriter, checkpointer, close


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--persist-every", type=int, default=10, help="persist every N steps (0: never)")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    p.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    p.add_argument("--digest-dir", default="", help="append JSON lines of state digests here, per rank")
    p.add_argument(
        "--unbroken-digest",
        action="store_true",
        help="at the end, train a fresh model through every step without checkpoints and log its digest",
    )
    return p.parse_args()


def build(hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model on every rank (seeded), sharded by FSDP2 over all ranks: uneven shards included."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 3)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``, a function of the step: a resumed run sees what an unbroken one saw."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, torch.stack([x[:, :8].sum(1), x[:, 8:16].sum(1), x[:, 16:].sum(1)], dim=1)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> torch.Tensor:
    """One step of training on this rank's batch of ``step``; its loss."""
    x, y = batch(step, rank)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def app_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, opt)  # DTensors: each rank saves and loads its own shards
    return {"model": model_sd, "optim": optim_sd, "progress": {"step": step}}


def digest(state: dict[str, Any]) -> str:
    """sha256 of this rank's local shards and values, in key order."""
    h = hashlib.sha256()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key], f"{path}/{key}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{path}/{i}")
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(path.encode())
            h.update(local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{path}={value!r}".encode())

    walk({k: v for k, v in state.items() if k != "progress"}, "")
    return h.hexdigest()


def log_digest(directory: str, rank: int, entry: dict[str, Any]) -> None:
    if directory:
        entry["restart"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        with open(Path(directory) / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")


@record
def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # the same arithmetic in every incarnation: a resumed run matches bitwise
    rank = dist.get_rank()
    model, opt = build(args.hidden)
    # This script numbers its steps itself. Said before get_state_dict, whose zero-gradient optimizer step
    # (it creates Adam's state) phalanx-run would otherwise take for a completed step 0.
    report_step(-1)
    start = 0
    reader = FlashReader()
    if reader.locate() is not None:  # collective: the newest step every rank holds
        state = app_state(model, opt, -1)
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert state["progress"]["step"] == reader.step, state["progress"]
        start = reader.step + 1
        reads = reader.last_load.get("storage_reads")
        print(f"dcp: loaded step {reader.step} from {reader.source} (storage reads {reads})", flush=True)
        restored = digest(app_state(model, opt, reader.step))  # what the model and optimizer now hold
        loaded = {"loaded": reader.step, "source": reader.source, "storage_reads": reads, "digest": restored}
        log_digest(args.digest_dir, rank, loaded)
    # async_save plans on a thread of its own: its collectives get a group of their own (torch's advice).
    save_group = dist.new_group(backend="gloo") if args.async_save else None
    pending: Future[Any] | None = None
    for step in range(start, args.steps):
        loss = train_step(model, opt, step, rank)
        if args.step_time:
            time.sleep(args.step_time)
        report_step(step)
        state = app_state(model, opt, step)
        writer = FlashWriter(step=step, persist=args.persist_every > 0 and step % args.persist_every == 0)
        log_digest(args.digest_dir, rank, {"step": step, "digest": digest(state)})
        if pending is not None:
            pending.result()  # the previous save's planning: one at a time
        if save_group is not None:
            pending = dcp.async_save(state, storage_writer=writer, process_group=save_group)  # type: ignore[assignment]
        else:
            dcp.save(state, storage_writer=writer)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if pending is not None:
        pending.result()
    try:
        checkpointer().wait()
    except PersistError as exc:  # training is done; its snapshots stay in this node's memory
        print(f"dcp: {exc}", flush=True)
    close()
    if args.unbroken_digest:  # what a run that never stopped ends with: the batches depend on the step only
        model, opt = build(args.hidden)
        for step in range(args.steps):
            train_step(model, opt, step, rank)
        log_digest(args.digest_dir, rank, {"unbroken": digest(app_state(model, opt, args.steps - 1))})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
