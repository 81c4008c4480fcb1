"""A plain torchrun-style DDP training script (gloo, small MLP) that phalanx can keep alive.

Runs unchanged under ``torchrun`` and ``phalanx-run``. It checkpoints every step with ``torch.save`` (to a
temporary file, then an atomic rename) so a restart loses at most the step in flight, reports each step
to the agent with ``phalanx.report_step`` (a no-op under torchrun), and, with ``--step-log``, appends one
JSON line per completed step on rank 0: ``{"step", "time", "world_size", "restart"}``.

With ``--flash`` it uses phalanx's flash checkpoint instead: every step is saved into node-local shared
memory (a memory copy), every ``--persist-every`` steps it is also persisted to storage in the background
(``--ckpt`` is then a directory, unless ``phalanx-run --checkpoint-dir`` gives the storage), and at start
each rank loads the newest step all ranks hold, from memory when its node kept it. Each rank prints where
it loaded from: ``flash: loaded step S from memory (storage reads 0)``.

    torchrun --nproc-per-node 2 --standalone examples/ddp_mlp.py --steps 50 --ckpt /tmp/ckpt.pt
    phalanx-run --nproc-per-node 2 --standalone examples/ddp_mlp.py --steps 50 --ckpt /tmp/ckpt.pt
    phalanx-run --nproc-per-node 2 --standalone --checkpoint-dir /tmp/ckpt examples/ddp_mlp.py --flash
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: when the script itself began, for benchmarks/recovery.py

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

try:
    from phalanx import report_step
except ImportError:  # the script stays runnable where phalanx is not installed

    def report_step(step: int) -> None:
        del step


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--ckpt", default="", help="checkpoint file (saved every step by rank 0)")
    p.add_argument("--step-log", default="", help="append a JSON line per completed step (rank 0)")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--fail-at", type=int, default=-1, help="raise a ValueError at this step on every rank")
    p.add_argument("--pid-dir", default="", help="write rank<N>.pid here at start (for fault injection)")
    p.add_argument(
        "--flash", action="store_true", help="use phalanx's flash checkpoint instead of torch.save"
    )
    p.add_argument("--persist-every", type=int, default=10, help="with --flash: persist every N steps")
    p.add_argument("--state-mb", type=int, default=0, help="checkpoint this many MiB more (a big state)")
    p.add_argument("--start-log", default="", help="append a JSON line per start of the script (rank 0)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="adam imports torch._dynamo")
    return p.parse_args()


def save(path: Path, state: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


@record
def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.pid_dir:
        Path(args.pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    opt = (torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD)(model.parameters(), lr=0.01)
    extra = torch.zeros(args.state_mb * 2**18)  # float32: stands in for a big model's optimizer state
    start = 0
    flash = None
    ckpt = Path(args.ckpt) if args.ckpt and not args.flash else None
    if args.flash:
        from phalanx.checkpoint import Checkpointer, PersistError

        # The agent's host advertises its storage; under torchrun --ckpt names the directory.
        flash = Checkpointer(storage=os.environ.get("PHALANX_CHECKPOINT_STORAGE") or args.ckpt or "")
        # DDP replicas all hold the same state: after a round that renumbered the ranks, any local
        # snapshot will do, and the node's memory still serves the restarted ranks.
        loaded = flash.load(replicated=True)
        if loaded is not None:
            model.load_state_dict(loaded[1]["model"])
            opt.load_state_dict(loaded[1]["opt"])
            extra.copy_(loaded[1]["extra"])
            start = loaded[0] + 1
            info = flash.last_load
            print(f"flash: loaded step {loaded[0]} from {info.get('source')} "
                  f"(storage reads {info.get('storage_reads')})", flush=True)  # fmt: skip
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        extra.copy_(state["extra"])
        start = int(state["step"]) + 1
    ddp = DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(1234 + rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        print(f"world size {world}, starting at step {start} (restart {restart})", flush=True)
        if args.start_log:  # when this incarnation's script began and when it was ready to train
            with open(args.start_log, "a") as f:
                f.write(json.dumps({"started": STARTED, "ready": time.time(), "restart": restart}) + "\n")
    for step in range(start, args.steps):
        if step == args.fail_at:
            raise ValueError(f"bad batch at step {step}: loss is NaN")
        x = torch.randn(64, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        # A step is done once every rank finished it, and only then logged and saved: a restart, which
        # loads any replica's snapshot, never resumes after a step the log has not seen (unless rank 0,
        # the logger, died in between).
        dist.barrier()
        report_step(step)
        if rank == 0:
            if args.step_log:
                with open(args.step_log, "a") as f:
                    f.write(
                        json.dumps(
                            {"step": step, "time": time.time(), "world_size": world, "restart": restart}
                        )
                    )
                    f.write("\n")
            if step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0 and ckpt is not None:
            save(ckpt, {"model": model.state_dict(), "opt": opt.state_dict(), "extra": extra, "step": step})
        if flash is not None:  # every rank holds its own snapshot in memory
            persist = flash.storage is not None and args.persist_every > 0 and step % args.persist_every == 0
            try:
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "extra": extra}
                flash.save(step, state, persist=persist)
            except PersistError as exc:  # the snapshot is in memory; the next persist tries again
                print(f"flash: {exc}", flush=True)
    if flash is not None:
        try:
            flash.wait()
        except PersistError as exc:  # training is done; its snapshots stay in this node's memory
            print(f"flash: {exc}", flush=True)
        flash.close()
    # DDP holds the process group: dropped first, the group is destroyed here, with the interpreter alive,
    # instead of at exit, where gloo's threads can abort the process after training succeeded.
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
