"""Tensor-parallel layers: column/row-parallel linears, vocab-parallel embedding and cross-entropy,
head-sharded attention and the MLP, each optionally sequence parallel.

Every sharded parameter records the dimension it is split along (:func:`tensor_dim`), so a full tensor
can be sliced into this rank's shard (initialisation, comparison with the reference). Parameters that are
replicated across the tensor group but only see part of the sequence under sequence parallelism (layer
norms, row-parallel biases, position embeddings) are marked :func:`is_sequence_parallel`: their gradients
are partial sums that the trainer all-reduces over the tensor group before the optimizer step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx import intervals
from phalanx.trainer import comm
from phalanx.trainer.comm import Group

_TP_DIM = "phalanx_tensor_dim"
_SP = "phalanx_sequence_parallel"


def tensor_dim(param: torch.Tensor) -> int | None:
    """Dimension along which ``param`` is sharded over the tensor group, or None if replicated."""
    dim: int | None = getattr(param, _TP_DIM, None)
    return dim


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient must be summed over the tensor group (sequence parallelism)."""
    return bool(getattr(param, _SP, False))


def _mark(param: nn.Parameter, *, dim: int | None = None, sequence_parallel: bool = False) -> nn.Parameter:
    setattr(param, _TP_DIM, dim)
    setattr(param, _SP, sequence_parallel)
    return param


def _group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor degree ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its output dimension; the output stays sharded.

    Input is replicated (or, sequence parallel, a sequence chunk that is all-gathered first).
    """

    def __init__(
        self, in_features: int, out_features: int, *, group: Group, sequence_parallel: bool, bias: bool = True
    ) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel and _group_size(group) > 1
        local = _divide(out_features, _group_size(group), "output features")
        self.weight = _mark(nn.Parameter(torch.empty(local, in_features)), dim=0)
        self.bias = _mark(nn.Parameter(torch.zeros(local)), dim=0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = comm.gather_from_sequence_region(x, self.group)
        else:
            x = comm.copy_to_tensor_region(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its input dimension; the input arrives sharded.

    The partial products are all-reduced (or, sequence parallel, reduce-scattered along the sequence);
    the bias is added once, after the reduction.
    """

    def __init__(
        self, in_features: int, out_features: int, *, group: Group, sequence_parallel: bool, bias: bool = True
    ) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel and _group_size(group) > 1
        local = _divide(in_features, _group_size(group), "input features")
        self.weight = _mark(nn.Parameter(torch.empty(out_features, local)), dim=1)
        self.bias = (
            _mark(nn.Parameter(torch.zeros(out_features)), sequence_parallel=self.sequence_parallel)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence_region(y, self.group)
        else:
            y = comm.reduce_from_tensor_region(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the tensor group.

    Each rank looks up only the ids in its range and returns zeros elsewhere; the caller reduces the
    partial results (all-reduce, or reduce-scatter along the sequence).
    """

    def __init__(self, vocab: int, hidden: int, *, group: Group) -> None:
        super().__init__()
        self.group = group
        local = _divide(vocab, _group_size(group), "vocabulary")
        self.start = _group_rank(group) * local
        self.end = self.start + local
        self.weight = _mark(nn.Parameter(torch.empty(local, hidden)), dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if _group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
        # Numerically stable softmax over a vocabulary that no rank holds whole: three small all-reduces
        # (max, target logit, sum of exponentials) instead of gathering the logits.
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        if _group_size(group) > 1:
            with intervals.collective("all_reduce", group=group, label="tp"):
                dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        start = _group_rank(group) * vocab_local
        outside = (target < start) | (target >= start + vocab_local)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if _group_size(group) > 1:
            both = torch.stack([picked, sum_exp])
            with intervals.collective("all_reduce", group=group, label="tp"):
                dist.all_reduce(both, group=group)
            picked, sum_exp = both[0], both[1]
        loss = sum_exp.log() - picked
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, outside, local_target = ctx.saved_tensors
        grad_input = softmax.clone()
        inside = (~outside).to(grad_input.dtype)
        grad_input.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        return grad_input * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
    """Per-token cross-entropy of logits whose last (vocabulary) dimension is split over ``group``."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)  # type: ignore[no-any-return]


class LayerNorm(nn.LayerNorm):
    """A layer norm whose parameters are marked sequence parallel when the block is."""

    def __init__(self, hidden: int, *, sequence_parallel: bool) -> None:
        super().__init__(hidden)
        _mark(self.weight, sequence_parallel=sequence_parallel)
        _mark(self.bias, sequence_parallel=sequence_parallel)


class ParallelAttention(nn.Module):
    """Causal multi-head self-attention with the heads split over the tensor group.

    The fused QKV projection stores its output rows head by head (``[head, q|k|v, head_dim]``) so a
    contiguous slice of rows is a contiguous set of whole heads; a single-process model uses the same
    layout, which makes its weights directly comparable.
    """

    def __init__(self, hidden: int, heads: int, *, group: Group, sequence_parallel: bool) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.head_dim = hidden // heads
        self.local_heads = _divide(heads, _group_size(group), "attention heads")
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group=group, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(hidden, hidden, group=group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, local_heads * 3 * head_dim]
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.local_heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)  # [3, b, h, s, d]
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.proj(out)  # type: ignore[no-any-return]


class ParallelMLP(nn.Module):
    """Column-parallel expansion, GELU, row-parallel projection: one reduction per MLP."""

    def __init__(self, hidden: int, ffn: int, *, group: Group, sequence_parallel: bool) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn, group=group, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn, hidden, group=group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, hidden: int, heads: int, ffn: int, *, group: Group, sequence_parallel: bool) -> None:
        super().__init__()
        sp = sequence_parallel and _group_size(group) > 1
        self.ln1 = LayerNorm(hidden, sequence_parallel=sp)
        self.attn = ParallelAttention(hidden, heads, group=group, sequence_parallel=sp)
        self.ln2 = LayerNorm(hidden, sequence_parallel=sp)
        self.mlp = ParallelMLP(hidden, ffn, group=group, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


def init_std(name: str, *, hidden: int, layers: int) -> float:
    """GPT-2 style init: N(0, 0.02), output projections scaled down by sqrt(2 * layers)."""
    if name.endswith(("proj.weight", "fc2.weight")):
        return 0.02 / math.sqrt(2 * layers)
    return 0.02
