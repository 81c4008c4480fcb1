"""Tensor-parallel communication as autograd Functions (the Megatron "regions").

Each function's backward is the adjoint of its forward: an all-reduce in forward is an identity in
backward and vice versa; an all-gather along a dimension is a reduce-scatter (sequence parallel) or a
split (plain tensor parallel) in backward. With ``group=None`` (a tensor degree of one) every function is
the identity, which is how the single-process reference runs the very same model code.

Sequence-parallel tensors are laid out ``[sequence, batch, hidden]`` so the sequence is dimension 0 and
``all_gather_into_tensor``/``reduce_scatter_tensor`` work on contiguous chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx import intervals

Group = dist.ProcessGroup | None


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous().clone()  # never reduce in place into a tensor autograd saved
    with intervals.collective("all_reduce", group=group, label="tp"):
        dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    rank = dist.get_rank(group)
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    with intervals.collective("all_gather", group=group, label="tp"):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    rank = dist.get_rank(group)
    return x.chunk(size, dim=0)[rank].contiguous()


def _gather_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with intervals.collective("all_gather", group=group, label="tp"):
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = _size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor degree {size}")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with intervals.collective("reduce_scatter", group=group, label="tp"):
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _identity(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x


Op = Callable[[torch.Tensor, Group], torch.Tensor]


def _region(name: str, forward: Op, backward: Op) -> type[torch.autograd.Function]:
    """An autograd Function that computes ``forward(x, group)`` and whose gradient is
    ``backward(grad, group)``: every region below is one pair of the communication functions above."""

    def run_forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return forward(x, group)

    def run_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(grad, ctx.group), None

    body = {"forward": staticmethod(run_forward), "backward": staticmethod(run_backward)}
    return type(name, (torch.autograd.Function,), body)


_CopyToRegion = _region("_CopyToRegion", _identity, _all_reduce)
_ReduceFromRegion = _region("_ReduceFromRegion", _all_reduce, _identity)
_ScatterToRegion = _region("_ScatterToRegion", _split_last, _gather_last)
_GatherFromRegion = _region("_GatherFromRegion", _gather_last, _split_last)
_ScatterToSequence = _region("_ScatterToSequence", _split_first, _gather_first)
# Every rank used the whole gathered sequence, so the gradient of its own chunk is the sum over ranks.
_GatherFromSequence = _region("_GatherFromSequence", _gather_first, _reduce_scatter_first)
_ReduceScatterToSequence = _region("_ReduceScatterToSequence", _reduce_scatter_first, _gather_first)


def copy_to_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce backward: the input of a column-parallel linear."""
    return _CopyToRegion.apply(x, group)  # type: ignore[no-any-return]


def reduce_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward, identity backward: the output of a row-parallel linear."""
    return _ReduceFromRegion.apply(x, group)  # type: ignore[no-any-return]


def scatter_to_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keeps this rank's slice of the last dimension; all-gathers it back in backward."""
    return _ScatterToRegion.apply(x, group)  # type: ignore[no-any-return]


def gather_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gathers the last dimension; backward keeps this rank's slice."""
    return _GatherFromRegion.apply(x, group)  # type: ignore[no-any-return]


def scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keeps this rank's chunk of the sequence (dim 0); all-gathers in backward."""
    return _ScatterToSequence.apply(x, group)  # type: ignore[no-any-return]


def gather_from_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gathers the sequence (dim 0) before a column-parallel linear; reduce-scatters in backward."""
    return _GatherFromSequence.apply(x, group)  # type: ignore[no-any-return]


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Reduce-scatters partial sums along the sequence (dim 0); all-gathers in backward.

    Replaces the all-reduce after a row-parallel linear when sequence parallelism is on.
    """
    return _ReduceScatterToSequence.apply(x, group)  # type: ignore[no-any-return]
