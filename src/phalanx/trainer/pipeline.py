"""Micro-batch schedules: 1F1B across pipeline stages, and plain gradient accumulation without one.

1F1B (PipeDream-Flush, as in Megatron-LM): stage ``p`` of ``P`` runs ``P - p - 1`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards. At most ``P - p`` micro-batches
are in flight per stage, instead of all of them (GPipe). Activations and their gradients move between
stages point to point; every exchange posts its sends and receives together (``batch_isend_irecv``) so
neighbouring stages can never wait on each other in a cycle.

Every send and receive is recorded by the interval recorder (:mod:`phalanx.intervals`) as ``send`` or
``recv`` in the group of its channel, ``pp:SRC>DST`` (global ranks), numbered per channel: the n-th send
from SRC to DST and the n-th receive of DST from SRC carry the same number, so a stage stuck in ``recv #7 of
pp:2>3`` names its peer, and rank 2, which never entered #7 of that channel, is the suspect.

Backwards run in micro-batch order on every stage, so the last backward is the last micro-batch: the
data-parallel gradient sync is switched on just before it (``before_last_backward``), which lets its
bucketed all-reduces overlap with that backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx import intervals
from phalanx.api.intervals import channel_name
from phalanx.trainer.mesh import Mesh
from phalanx.trainer.model import GPTStage


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """One micro-batch: token ids and targets ``[batch, seq]`` and its weight in the global mean loss."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weight: float


class _Exchange:
    """Point-to-point transfers of fixed-shape activations between neighbouring stages."""

    def __init__(self, mesh: Mesh, *, shape: Callable[[int], tuple[int, ...]], device: torch.device) -> None:
        self.mesh = mesh
        self.shape = shape
        self.device = device

    def __call__(
        self,
        *,
        send_next: torch.Tensor | None = None,
        recv_prev: bool = False,
        send_prev: torch.Tensor | None = None,
        recv_next: bool = False,
        batch: int = 0,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ops: list[dist.P2POp] = []
        from_prev = from_next = None
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.mesh.prev_stage_rank()))
        if recv_prev:
            from_prev = torch.empty(self.shape(batch), device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.mesh.prev_stage_rank()))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.mesh.next_stage_rank()))
        if recv_next:
            from_next = torch.empty(self.shape(batch), device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.mesh.next_stage_rank()))
        if ops:
            me = dist.get_rank()
            # Each op is an interval of its own: the one that never completes names the stuck direction.
            tokens = [
                intervals.begin("send", group=channel_name(me, op.peer))
                if op.op is dist.isend
                else intervals.begin("recv", group=channel_name(op.peer, me))
                for op in ops
            ]
            for work, token in zip(dist.batch_isend_irecv(ops), tokens, strict=True):
                work.wait()
                intervals.end(token)
        return from_prev, from_next


def run_micro_batches(
    stage: GPTStage,
    micro_batches: Sequence[MicroBatch],
    *,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
    before_last_backward: Callable[[], None] = lambda: None,
) -> torch.Tensor:
    """Forward and backward over all micro-batches; returns this stage's summed weighted loss (0 if not last).

    Uses 1F1B when the pipeline has more than one stage, otherwise forward-backward per micro-batch.
    Gradients accumulate in ``.grad``; the caller zeroes them and steps the optimizer.
    """
    mesh = stage.mesh
    total = torch.zeros((), device=device)
    count = len(micro_batches)
    sizes = [mb.inputs.shape[0] for mb in micro_batches]

    def forward(index: int, received: torch.Tensor | None) -> torch.Tensor:
        nonlocal total
        mb = micro_batches[index]
        with autocast():
            out = stage(mb.inputs.to(device) if stage.is_first else received)
            if stage.is_last:
                out = stage.loss(out, mb.targets.to(device)) * mb.weight
        if stage.is_last:
            total = total + out.detach().float()
        result: torch.Tensor = out
        return result

    def backward(
        index: int, received: torch.Tensor | None, output: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        if index == count - 1:
            before_last_backward()
        torch.autograd.backward(output, grad_tensors=None if stage.is_last else grad)
        return None if received is None else received.grad

    if mesh.pipeline_size == 1:
        for i in range(count):
            backward(i, None, forward(i, None), None)
        return total

    exchange = _Exchange(mesh, shape=stage.activation_shape, device=device)

    def recv_forward(index: int) -> torch.Tensor | None:
        if stage.is_first:
            return None
        got, _ = exchange(recv_prev=True, batch=sizes[index])
        assert got is not None
        return got.requires_grad_()

    def send_forward(out: torch.Tensor) -> None:
        if not stage.is_last:
            exchange(send_next=out.detach())

    warmup = min(mesh.pipeline_size - mesh.coord.pipeline - 1, count)
    remaining = count - warmup
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    done_backward = 0

    for i in range(warmup):
        received = recv_forward(i)
        out = forward(i, received)
        send_forward(out)
        inputs.append(received)
        outputs.append(out)

    received = recv_forward(warmup) if remaining > 0 else None
    for i in range(remaining):
        out = forward(warmup + i, received)
        inputs.append(received)
        outputs.append(out)
        grad_out = None
        if not stage.is_last:
            _, grad_out = exchange(send_next=out.detach(), recv_next=True, batch=sizes[done_backward])
        grad_in = backward(done_backward, inputs.pop(0), outputs.pop(0), grad_out)
        done_backward += 1
        last = i == remaining - 1
        if stage.is_first:
            received = None
        elif last:
            exchange(send_prev=grad_in)
            received = None
        else:
            received, _ = exchange(send_prev=grad_in, recv_prev=True, batch=sizes[warmup + i + 1])
            assert received is not None
            received.requires_grad_()

    for _ in range(warmup):
        grad_out = None
        if not stage.is_last:
            _, grad_out = exchange(recv_next=True, batch=sizes[done_backward])
        grad_in = backward(done_backward, inputs.pop(0), outputs.pop(0), grad_out)
        done_backward += 1
        if not stage.is_first:
            exchange(send_prev=grad_in)
    return total
