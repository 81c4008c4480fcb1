"""A GPT-style decoder built from the parallel layers, split into pipeline stages.

A stage holds a contiguous run of blocks; the first stage also holds the embeddings, the last the final
norm and the vocab-parallel LM head. Blocks are keyed by their global index, so parameter names are the
same in every layout (``blocks.3.mlp.fc1.weight``) and a stage's parameters can be matched one to one
with the single-process reference. Initialisation is a pure function of (seed, parameter name): every
rank draws the full tensor and keeps its shard, so every layout starts from the same weights.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.api.errors import ConfigError
from phalanx.trainer import comm
from phalanx.trainer.layers import (
    Block,
    ColumnParallelLinear,
    LayerNorm,
    VocabParallelEmbedding,
    init_std,
    tensor_dim,
    vocab_parallel_cross_entropy,
)
from phalanx.trainer.mesh import Mesh


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model and the per-model parallel options."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 64
    seq_len: int = 16
    ffn_mult: int = 4
    sequence_parallel: bool = False
    """Shard layer norms, dropouts and residuals along the sequence over the tensor group."""
    recompute: bool = False
    """Recompute each block's activations in backward instead of keeping them."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq_len", "ffn_mult"):
            if getattr(self, name) < 1:
                raise ConfigError("must be at least 1", field=name)


def stage_layers(*, layers: int, stages: int, stage: int) -> range:
    """Global indices of the blocks on ``stage``; earlier stages take the remainder (pure)."""
    if stages > layers:
        raise ConfigError(
            f"{stages} pipeline stages need at least as many layers, not {layers}", field="pipeline"
        )
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class GPTStage(nn.Module):
    """This rank's part of the model: one pipeline stage, one tensor shard."""

    def __init__(self, config: GPTConfig, mesh: Mesh) -> None:
        super().__init__()
        self.config = config
        self.mesh = mesh
        group = mesh.tensor_group
        sp = config.sequence_parallel and mesh.tensor_size > 1
        self.sequence_parallel = sp
        if sp and config.seq_len % mesh.tensor_size:
            raise ConfigError(
                f"sequence length {config.seq_len} is not divisible by the tensor degree {mesh.tensor_size}",
                field="seq_len",
            )
        self.is_first = mesh.is_first_stage
        self.is_last = mesh.is_last_stage
        if self.is_first:
            self.embed = VocabParallelEmbedding(config.vocab, config.hidden, group=group)
            self.pos = nn.Parameter(torch.empty(config.seq_len, config.hidden))
            self.pos.phalanx_sequence_parallel = sp  # type: ignore[attr-defined]
        indices = stage_layers(layers=config.layers, stages=mesh.pipeline_size, stage=mesh.coord.pipeline)
        ffn = config.ffn_mult * config.hidden
        self.blocks = nn.ModuleDict(
            {
                str(i): Block(config.hidden, config.heads, ffn, group=group, sequence_parallel=sp)
                for i in indices
            }
        )
        if self.is_last:
            self.ln_f = LayerNorm(config.hidden, sequence_parallel=sp)
            self.head = ColumnParallelLinear(
                config.hidden, config.vocab, group=group, sequence_parallel=sp, bias=False
            )

    def activation_shape(self, micro_batch: int) -> tuple[int, int, int]:
        """Shape of the hidden states passed between stages: ``[sequence (chunk), batch, hidden]``."""
        seq = self.config.seq_len // (self.mesh.tensor_size if self.sequence_parallel else 1)
        return (seq, micro_batch, self.config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``[batch, seq]`` on the first stage, hidden states from the previous stage otherwise."""
        group = self.mesh.tensor_group
        if self.is_first:
            partial = self.embed(x).transpose(0, 1).contiguous()  # [s, b, h], partial over vocab shards
            if self.sequence_parallel:
                h = comm.reduce_scatter_to_sequence_region(partial, group)
                chunk = self.config.seq_len // self.mesh.tensor_size
                start = self.mesh.coord.tensor * chunk
                x = h + self.pos[start : start + chunk].unsqueeze(1)
            else:
                x = comm.reduce_from_tensor_region(partial, group) + self.pos.unsqueeze(1)
        for block in self.blocks.values():
            if self.config.recompute and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the micro-batch (last stage only); targets ``[batch, seq]``."""
        logits = self.head(self.ln_f(hidden))  # [s, b, vocab / tensor]
        per_token = vocab_parallel_cross_entropy(logits, targets.transpose(0, 1), self.mesh.tensor_group)
        return per_token.mean()


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def full_parameter(name: str, shape: torch.Size, *, seed: int, config: GPTConfig) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name`` (pure in seed and name)."""
    leaf = name.rsplit(".", 1)[-1]
    if ".ln" in f".{name}":
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    std = 0.01 if name == "pos" else init_std(name, hidden=config.hidden, layers=config.layers)
    return torch.randn(shape, generator=gen) * std


def shard(full: torch.Tensor, *, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """This tensor rank's slice of ``full`` along ``dim`` (the whole tensor when replicated)."""
    if dim is None or size == 1:
        return full
    return full.chunk(size, dim=dim)[rank]


@torch.no_grad()
def initialize(stage: GPTStage, *, seed: int) -> None:
    """Fills ``stage``'s parameters with its shards of the seed's full initial weights."""
    size, rank = stage.mesh.tensor_size, stage.mesh.coord.tensor
    for name, param in stage.named_parameters():
        dim = tensor_dim(param)
        full_shape = list(param.shape)
        if dim is not None:
            full_shape[dim] *= size
        full = full_parameter(name, torch.Size(full_shape), seed=seed, config=stage.config)
        param.copy_(shard(full, dim=dim, rank=rank, size=size))
