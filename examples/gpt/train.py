"""A small GPT learning a synthetic task with tensor, pipeline and elastic data parallelism.

The task: sequences ``x[i+1] = (x[i] + x[i-1]) mod vocab`` from two random seeds. Everything after the
second token is predictable, so the loss falls from ln(vocab) towards ln(vocab) * 2 / seq_len as the model
learns modular addition. The batch of step ``s`` depends only on (seed, s), so when the data-parallel
degree changes the same global batch is simply re-split and the loss curve continues.

Runs under torchrun, ``phalanx-run`` (in-process regroup when a node is lost) and ``phalanx local``::

    torchrun --nproc-per-node 4 examples/gpt/train.py --tp 2 --pp 2 --steps 300 --log-json /tmp/gpt.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.api.errors import PersistError
from phalanx.trainer import (
    ElasticConfig,
    ElasticTrainer,
    FileCheckpoint,
    FlashCheckpoint,
    GPTConfig,
    OptimConfig,
    ParallelConfig,
)


def make_batches(*, seed: int, batch: int, seq_len: int, vocab: int) -> Callable[[int], torch.Tensor]:
    """The global batch of a step, a pure function of (seed, step): re-splitting it never changes it."""

    def batches(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        seq = torch.empty(batch, seq_len + 1, dtype=torch.int64)
        seq[:, :2] = torch.randint(0, vocab, (batch, 2), generator=gen)
        for i in range(2, seq_len + 1):
            seq[:, i] = (seq[:, i - 1] + seq[:, i - 2]) % vocab
        return seq

    return batches


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-json",
        default="",
        help="append one JSON line per step and event here ({rank}: the first global rank, {pid}: the pid)",
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--recompute", action="store_true")
    p.add_argument(
        "--ckpt",
        choices=("flash", "file"),
        default="flash",
        help="flash: shared memory, persisted to --ckpt-dir in the background; file: safetensors files",
    )
    p.add_argument(
        "--ckpt-dir",
        default="",
        help="checkpoint storage (flash default: $PHALANX_CHECKPOINT_STORAGE, else memory only)",
    )
    p.add_argument("--ckpt-every", type=int, default=0, help="save every this many steps (0: never)")
    p.add_argument("--persist-every", type=int, default=1, help="flash: persist every this many saves")
    p.add_argument(
        "--ckpt-behind",
        action="store_true",
        help="flash: copy each save behind the next step's forward and backward (fenced before its update)",
    )
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--digest", action="store_true", help="log a state digest after every (re)group")
    p.add_argument("--pace-ms", type=float, default=0.0, help="sleep this long per step (demos and tests)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = GPTConfig(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        seq_len=args.seq_len,
        sequence_parallel=args.sp,
        recompute=args.recompute,
    )
    config = ElasticConfig(
        model=model,
        parallel=ParallelConfig(tensor=args.tp, pipeline=args.pp),
        optim=OptimConfig(lr=args.lr),
        seed=args.seed,
        global_batch=args.global_batch,
        micro_batches=args.micro_batches,
        checkpoint_every=args.ckpt_every,
        collective_timeout_s=args.collective_timeout,
        digest=args.digest,
    )
    path = args.log_json.replace("{rank}", os.environ.get("RANK", "0")).replace("{pid}", str(os.getpid()))
    log = Path(path).open("a", buffering=1) if path else None  # noqa: SIM115

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") not in ("step", "checkpoint"):  # those two go to --log-json only
            print(json.dumps(event), file=sys.stderr, flush=True)
        elif args.pace_ms:
            time.sleep(args.pace_ms / 1000)
        if log is not None:
            log.write(json.dumps(event) + "\n")

    checkpoint: FileCheckpoint | FlashCheckpoint | None = None
    if args.ckpt == "file" and args.ckpt_dir:
        checkpoint = FileCheckpoint(Path(args.ckpt_dir))
    elif args.ckpt == "flash" and (args.ckpt_every or args.ckpt_dir):
        checkpoint = FlashCheckpoint(
            parallel=config.parallel,
            storage_location=args.ckpt_dir or None,
            persist_every=args.persist_every,
            behind=args.ckpt_behind,
        )
    batches = make_batches(seed=args.seed, batch=args.global_batch, seq_len=args.seq_len, vocab=args.vocab)
    trainer = ElasticTrainer(
        config,
        batches=batches,
        checkpoint=checkpoint,
        on_event=on_event,
    )
    code = trainer.run(args.steps)
    if isinstance(checkpoint, FlashCheckpoint):
        try:
            checkpoint.close()  # waits for the background persistence of the last saves
        except PersistError as exc:  # training is done; the last snapshots stay in this node's memory
            on_event({"event": "checkpoint_failed", "step": trainer.step, "error": str(exc)[:300]})
    if log is not None:
        log.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
