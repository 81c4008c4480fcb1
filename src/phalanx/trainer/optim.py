"""AdamW over plain tensors, with its state created up front.

``torch.optim`` would do, but constructing any ``torch.optim.Optimizer`` imports TorchDynamo (seconds of
start-up per process, which a restart pays again), and its state appears lazily at the first step. Here
the state exists from construction, so a fresh rank holds exactly the tensors a trained rank holds and
the recovery broadcast can fill them in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class AdamW:
    """Decoupled-weight-decay Adam (Loshchilov and Hutter), same update as ``torch.optim.AdamW``."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self.params = list(params)
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = torch.zeros(1)
        """Optimizer steps taken (a tensor so it travels with the rest of the state)."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        t = float(self.steps.item())
        beta1, beta2 = self.betas
        bias1 = 1 - beta1**t
        bias2 = 1 - beta2**t
        step_size = self.lr / bias1
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True):
            if p.grad is None:
                continue
            if self.weight_decay:
                p.mul_(1 - self.lr * self.weight_decay)
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(bias2)).add_(self.eps)
            p.addcdiv_(m, denom, value=-step_size)
