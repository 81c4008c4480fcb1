"""The first save prepared without the script's help: a Checkpointer sizes its memory from the optimizers.

A save that finds no slots allocates them and first-touches their pages on the training path, which costs far
more than the copy itself (see docs/benchmarks.md). ``Checkpointer.prepare`` avoids that, and most scripts
never call it. What a training script saves is, in the main, its model's parameters and its optimizers' state,
and both exist once the optimizers have stepped (Adam makes its moments in its first step). So, while its
process has no slots, a Checkpointer watches torch's global optimizer step hook: at an optimizer's second step
(by then every optimizer of the loop has stepped once) it prepares slots for the parameters and state of every
optimizer it saw, in the background, and stops watching. The first save then finds them mapped. A save larger
than that (buffers, tensors of its own beyond the slots' headroom) is sized again by that save, as before; a
restarted process, which adopts its slots from the host, never watches.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def estimated_state(optimizers: list[torch.optim.Optimizer]) -> dict[str, list[torch.Tensor]]:
    """A state with the tensors a save of these optimizers' training will hold: their parameters and the
    tensors of their state (moments, step counts)."""
    parameters: list[torch.Tensor] = []
    moments: list[torch.Tensor] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            parameters += [p for p in group["params"] if isinstance(p, torch.Tensor)]
        for per_param in optimizer.state.values():
            moments += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return {"parameters": parameters, "optimizer": moments}


_watches: weakref.WeakSet[OptimizerWatch] = weakref.WeakSet()
_hooked = False


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global optimizer step post-hook, registered once per process: every watch hears every step.
    Never removed (torch iterates its hooks while it calls them; a watch that is done leaves this set
    instead), and a no-op once no watch is left."""
    for watch in list(_watches):
        watch.stepped(optimizer)


class OptimizerWatch:
    """Calls ``prepare(estimated_state(...))`` once, at the first optimizer's second step, then stops.

    Holds ``prepare``'s object weakly: a Checkpointer dropped without ``close()`` is not kept alive by the
    process-wide hook."""

    def __init__(self, prepare: Callable[[Any], None]) -> None:
        global _hooked
        self._prepare = weakref.WeakMethod(prepare)
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        if not _hooked:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            register_optimizer_step_post_hook(_stepped)
            _hooked = True
        _watches.add(self)

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._seen:
            self._seen.add(optimizer)
            return
        self.stop()
        prepare = self._prepare()
        if prepare is None:
            return
        try:
            prepare(estimated_state(list(self._seen)))
        except Exception:  # preparing is an optimisation: a failure must not fail the optimizer step
            log.warning("could not prepare the checkpoint memory from the optimizer", exc_info=True)

    def stop(self) -> None:
        _watches.discard(self)
