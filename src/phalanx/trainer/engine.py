"""One rank's training step: split the global batch, run the micro-batch schedule, sync, step.

The :class:`Engine` owns this rank's model stage, its optimizer and the data-parallel gradient sync. It
knows nothing of membership: the elastic loop (:mod:`phalanx.trainer.elastic`) builds a new engine, or
re-binds this one to new groups, whenever the mesh changes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx import intervals
from phalanx.trainer.data_parallel import GradientSync, sync_sequence_parallel_grads
from phalanx.trainer.mesh import Mesh
from phalanx.trainer.model import GPTConfig, GPTStage, initialize
from phalanx.trainer.optim import AdamW
from phalanx.trainer.pipeline import MicroBatch, run_micro_batches


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW settings."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0


def split_batch(
    tokens: torch.Tensor, *, data_rank: int, data_size: int, micro_batches: int
) -> list[MicroBatch]:
    """This data rank's micro-batches of a global batch ``[batch, seq + 1]`` (pure).

    The global batch is cut into ``data_size`` nearly equal parts (so any data degree works), each part
    into ``micro_batches``; every micro-batch's loss is weighted by its share of the global batch so the
    summed gradients equal those of the global mean loss.
    """
    total = tokens.shape[0]
    local = torch.tensor_split(tokens, data_size)[data_rank]
    count = min(micro_batches, local.shape[0])
    out = []
    for part in torch.tensor_split(local, count):
        out.append(MicroBatch(inputs=part[:, :-1], targets=part[:, 1:], weight=part.shape[0] / total))
    return out


def default_device() -> torch.device:
    """The local GPU under NCCL, else the CPU."""
    if torch.cuda.is_available():
        import os

        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


class Engine:
    """Model stage + optimizer + gradient sync of one rank."""

    def __init__(
        self,
        *,
        model: GPTConfig,
        mesh: Mesh,
        seed: int,
        optim: OptimConfig | None = None,
        micro_batches: int = 1,
        device: torch.device | None = None,
        bucket_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.model_config = model
        self.mesh = mesh
        self.micro_batches = micro_batches
        self.device = device or torch.device("cpu")
        self.bucket_bytes = bucket_bytes
        self.stage = GPTStage(model, mesh)
        initialize(self.stage, seed=seed)
        self.stage.to(self.device)
        optim = optim or OptimConfig()
        self.optimizer = AdamW(
            self.stage.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
        self.sync = GradientSync(self.stage.parameters(), group=mesh.data_group, bucket_bytes=bucket_bytes)

    def autocast(self) -> AbstractContextManager[object]:
        """bf16 autocast on GPU; full fp32 on CPU (CPU bf16 is slow and would blur the reference checks)."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Accumulates this rank's gradients for the global batch ``tokens`` and syncs them.

        Returns this rank's share of the loss (non-zero only on the last stage).
        """
        self.optimizer.zero_grad()
        self.sync.reset()
        micro = split_batch(
            tokens,
            data_rank=self.mesh.coord.data,
            data_size=self.mesh.data_size,
            micro_batches=self.micro_batches,
        )
        loss = run_micro_batches(
            self.stage,
            micro,
            device=self.device,
            autocast=self.autocast,
            before_last_backward=self.sync.arm,
        )
        self.sync.finish()
        sync_sequence_parallel_grads(self.stage.parameters(), group=self.mesh.tensor_group)
        return loss

    def global_loss(self, local: torch.Tensor) -> float:
        """The global mean loss, known on every rank (one small all-reduce)."""
        value = local.detach().clone().reshape(1).float()
        if not (self.mesh.is_last_stage and self.mesh.coord.tensor == 0):
            value.zero_()  # count each data replica's loss once
        if self.mesh.world_size > 1:
            with intervals.collective("all_reduce", label="world"):
                dist.all_reduce(value)
        return float(value.item())

    def train_step(self, tokens: torch.Tensor, *, before_update: Callable[[], None] | None = None) -> float:
        """One optimizer step on the global batch; returns the global mean loss.

        The loss is reduced before the optimizer step so that, once any rank updates its weights, no
        collective of this step is left that could fail and leave the ranks at different steps.
        ``before_update`` runs after forward and backward, just before the weights change (a checkpoint
        copied behind the step is fenced there).
        """
        loss = self.global_loss(self.forward_backward(tokens))
        if before_update is not None:
            before_update()
        self.optimizer.step()
        return loss

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the training state in a fixed order: parameters, then their optimizer state."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, p in self.stage.named_parameters():
            out.append((name, p.data))
        names = [name for name, _ in self.stage.named_parameters()]
        for name, m, v in zip(names, self.optimizer.exp_avg, self.optimizer.exp_avg_sq, strict=True):
            out.append((f"optim.{name}.exp_avg", m))
            out.append((f"optim.{name}.exp_avg_sq", v))
        out.append(("optim.steps", self.optimizer.steps))
        return out

    def release_groups(self) -> None:
        """Drops every reference this engine holds to process groups (the groups are being destroyed)."""
        self.sync.close()
        self.sync = GradientSync([], group=None)
        for module in self.stage.modules():
            if hasattr(module, "group"):
                module.group = None  # type: ignore[assignment]

    def rebind(self, mesh: Mesh) -> None:
        """Points the layers at ``mesh``'s groups (same coordinate, new groups) and rebuilds the sync."""
        if (mesh.coord.pipeline, mesh.coord.tensor) != (self.mesh.coord.pipeline, self.mesh.coord.tensor):
            raise ValueError("rebind keeps the stage and shard; build a new Engine for a new coordinate")
        self.sync.close()
        for module in self.stage.modules():
            if hasattr(module, "group"):
                module.group = mesh.tensor_group  # type: ignore[assignment]
        self.stage.mesh = mesh
        self.mesh = mesh
        self.sync = GradientSync(
            self.stage.parameters(), group=mesh.data_group, bucket_bytes=self.bucket_bytes
        )
