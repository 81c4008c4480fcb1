"""A distributed sampler whose position is part of the checkpoint and survives a change of world size.

Every epoch has one global order (a seeded permutation, or 0..n-1). Rank ``r`` of ``W`` takes the
remaining samples ``order[consumed:][r::W]``. After each rank took ``k`` samples, exactly
``order[consumed : consumed + k*W]`` were used, so the position is one number; when the world size
changes the remaining samples are re-split among the new ranks and none is repeated or skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


class ElasticDistributedSampler(Sampler[int]):
    """Yields this rank's share of the epoch's remaining samples; see the module docstring.

    ``state_dict()`` counts the samples this rank has yielded in the current epoch (all ranks advance in
    lock step), so save it together with the step that consumed them.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.consumed = 0  # samples of this epoch used by all ranks together before the current iterator
        self._yielded = 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        remaining = self._order()[self.consumed :]
        self._yielded = 0
        for index in remaining[self.rank :: self.num_replicas]:
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        left = self.dataset_len - self.consumed
        return max(0, (left - self.rank + self.num_replicas - 1) // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` from its beginning."""
        self.epoch = epoch
        self.consumed = 0
        self._yielded = 0

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and the samples of it consumed by all ranks together."""
        consumed = min(self.dataset_len, self.consumed + self._yielded * self.num_replicas)
        return {"epoch": self.epoch, "consumed": consumed, "seed": self.seed, "dataset_len": self.dataset_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at a saved position; the world size may differ from the one that saved it."""
        if int(state["dataset_len"]) != self.dataset_len:
            raise ValueError(
                f"the saved position is for {state['dataset_len']} samples, not {self.dataset_len}"
            )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self.seed = int(state["seed"])
        self._yielded = 0
