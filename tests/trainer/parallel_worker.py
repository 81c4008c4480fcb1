"""One rank of the layout-equivalence check: every layout against the single-process reference.

Each rank builds the reference model itself (same seed, no communication), runs its layout, and compares
its own shard of every gradient with the matching slice of the reference gradient. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.trainer.engine import Engine
from phalanx.trainer.layers import tensor_dim
from phalanx.trainer.mesh import Mesh, ParallelConfig
from phalanx.trainer.model import GPTConfig, shard

RTOL, ATOL = 1e-5, 1e-6
SEED = 7


def reference_grads(
    model: GPTConfig, tokens: torch.Tensor, *, micro: int
) -> tuple[float, dict[str, torch.Tensor]]:
    ref = Engine(model=model, mesh=Mesh(ParallelConfig()), seed=SEED, micro_batches=micro)
    loss = ref.global_loss(ref.forward_backward(tokens))
    return loss, {n: p.grad.clone() for n, p in ref.stage.named_parameters() if p.grad is not None}


def check(layout: dict[str, int], tokens: torch.Tensor) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPTConfig(
        layers=2,
        hidden=32,
        heads=4,
        vocab=32,
        seq_len=8,
        sequence_parallel=bool(layout.get("sp", 0)),
        recompute=bool(layout.get("recompute", 0)),
    )
    parallel = ParallelConfig(tensor=layout["tp"], pipeline=layout["pp"])
    micro = layout.get("micro", 1)
    mesh = Mesh(parallel, rank=rank, world_size=world)
    engine = Engine(model=model, mesh=mesh, seed=SEED, micro_batches=micro)
    loss = engine.global_loss(engine.forward_backward(tokens))
    ref_loss, ref = reference_grads(
        GPTConfig(layers=2, hidden=32, heads=4, vocab=32, seq_len=8), tokens, micro=micro
    )
    worst = 0.0
    names = []
    for name, p in engine.stage.named_parameters():
        assert p.grad is not None, name
        expected = shard(ref[name], dim=tensor_dim(p), rank=mesh.coord.tensor, size=mesh.tensor_size)
        if not torch.allclose(p.grad, expected, rtol=RTOL, atol=ATOL):
            names.append(name)
        worst = max(worst, float((p.grad - expected).abs().max()))
    return {
        "layout": layout,
        "loss": loss,
        "ref_loss": ref_loss,
        "bad": names,
        "max_abs_err": worst,
        "params": len(list(engine.stage.parameters())),
    }


def main() -> None:
    layouts = json.loads(sys.argv[1])
    dist.init_process_group(
        "gloo",
        init_method="env://",
        timeout=timedelta(seconds=200),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 32, (8, 9), generator=gen)
    results = [check(layout, tokens) for layout in layouts]
    dist.destroy_process_group()
    print(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
