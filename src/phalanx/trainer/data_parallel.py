"""Data-parallel gradient sync: bucketed all-reduces launched during backward.

Parameters are grouped into buckets in reverse registration order (roughly the order backward produces
their gradients). A post-accumulate-grad hook counts ready gradients; when a bucket is complete, its
gradients are flattened into one buffer and an asynchronous all-reduce starts while backward continues
with earlier layers. :meth:`GradientSync.finish` waits for all of them before the optimizer step.

The sync is armed only for the last micro-batch's backward (:meth:`GradientSync.arm`); earlier
micro-batches just accumulate, as with DDP's ``no_sync``. Gradients are summed, not averaged: the trainer
weights each micro-batch's loss by its share of the global batch, which keeps the result exact when the
data degree changes and the global batch no longer splits evenly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from phalanx import intervals
from phalanx.trainer.comm import Group
from phalanx.trainer.layers import is_sequence_parallel


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    ready: int = 0
    flat: torch.Tensor | None = None
    work: dist.Work | None = None
    members: set[int] = field(default_factory=set)
    token: intervals.Token | None = None
    """The interval recorder's record of the all-reduce in flight (None when the recorder is off)."""


class GradientSync:
    """Overlaps the data-parallel gradient all-reduce with backward."""

    def __init__(
        self, params: Iterable[torch.nn.Parameter], *, group: Group, bucket_bytes: int = 4 * 1024 * 1024
    ) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self._armed = False
        self._handles: list[RemovableHandle] = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        if self.size == 1:
            return
        current: list[torch.Tensor] = []
        param: torch.Tensor
        nbytes = 0
        for param in reversed([p for p in params if p.requires_grad]):
            current.append(param)
            nbytes += param.numel() * param.element_size()
            if nbytes >= bucket_bytes:
                self._add_bucket(current)
                current, nbytes = [], 0
        if current:
            self._add_bucket(current)
        for bucket in self._buckets:
            for p in bucket.params:
                handle = p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                self._handles.append(handle)

    def _add_bucket(self, params: list[torch.Tensor]) -> None:
        bucket = _Bucket(params=params)
        for p in params:
            self._bucket_of[id(p)] = bucket
        self._buckets.append(bucket)

    def arm(self) -> None:
        """Starts reducing gradients as they become ready (call before the last micro-batch's backward)."""
        self._armed = True

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(param)]
        if id(param) in bucket.members:
            return  # a parameter used twice in one backward reports twice; count it once
        bucket.members.add(id(param))
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        bucket.token = intervals.begin("all_reduce", group=self.group, label="dp")
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Waits for every bucket (launching any that backward did not complete) and writes the sums back."""
        if self.size == 1:
            self._armed = False
            return
        for bucket in self._buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self._buckets:
            assert bucket.work is not None
            assert bucket.flat is not None
            bucket.work.wait()
            intervals.end(bucket.token)  # on a GPU: once the device passes the all-reduce
            offset = 0
            for p in bucket.params:
                n = p.numel()
                chunk = bucket.flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
                offset += n
        self.reset()

    def reset(self) -> None:
        """Forgets any reduction in flight (an abandoned step) and disarms."""
        self._armed = False
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.flat = None
            bucket.work = None
            bucket.token = None
            bucket.members.clear()

    def close(self) -> None:
        """Removes the hooks; the parameters outlive this object when the groups are re-formed."""
        self.reset()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def sync_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], *, group: Group) -> None:
    """Sums over the tensor group the gradients of parameters that saw only a sequence chunk."""
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if is_sequence_parallel(p) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with intervals.collective("all_reduce", group=group, label="tp"):
        dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
