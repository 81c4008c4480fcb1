"""The (data, pipeline, tensor) process mesh.

Ranks are laid out tensor-fastest, then pipeline, then data::

    rank = tensor_rank + tensor * (pipeline_rank + pipeline * data_rank)

so a tensor group is a run of consecutive ranks (it stays inside a node when a node runs a multiple of
``tensor`` processes) and one data-parallel replica (all stages, all shards) is a contiguous block of
``tensor * pipeline`` ranks. Losing the node that holds a block therefore loses one replica, and the data
degree simply shrinks: ``data = world / (tensor * pipeline)`` follows membership.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from phalanx.api.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor and pipeline degrees; both are fixed for a job. The data degree follows the world size."""

    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        if self.tensor < 1:
            raise ConfigError("must be at least 1", field="tensor")
        if self.pipeline < 1:
            raise ConfigError("must be at least 1", field="pipeline")

    @property
    def model_parallel(self) -> int:
        """Processes that together hold one replica of the model."""
        return self.tensor * self.pipeline

    def data(self, world_size: int) -> int:
        """The data-parallel degree for ``world_size`` processes."""
        if world_size % self.model_parallel:
            raise ConfigError(
                f"world size {world_size} is not a multiple of tensor x pipeline = {self.model_parallel}",
                field="world_size",
            )
        return world_size // self.model_parallel


@dataclass(frozen=True, kw_only=True)
class Coord:
    """Where one rank sits in the mesh."""

    data: int
    pipeline: int
    tensor: int


def coord_of(rank: int, *, config: ParallelConfig) -> Coord:
    """The mesh coordinate of ``rank`` (pure)."""
    tensor = rank % config.tensor
    pipeline = (rank // config.tensor) % config.pipeline
    data = rank // config.model_parallel
    return Coord(data=data, pipeline=pipeline, tensor=tensor)


def rank_of(coord: Coord, *, config: ParallelConfig) -> int:
    """The rank at ``coord`` (pure; inverse of :func:`coord_of`)."""
    return coord.tensor + config.tensor * (coord.pipeline + config.pipeline * coord.data)


def group_ranks(*, config: ParallelConfig, world_size: int) -> dict[str, list[list[int]]]:
    """Every tensor, pipeline and data group of the mesh as lists of global ranks (pure)."""
    data = config.data(world_size)
    groups: dict[str, list[list[int]]] = {"tensor": [], "pipeline": [], "data": []}
    for d in range(data):
        for p in range(config.pipeline):
            groups["tensor"].append(
                [rank_of(Coord(data=d, pipeline=p, tensor=t), config=config) for t in range(config.tensor)]
            )
    for d in range(data):
        for t in range(config.tensor):
            groups["pipeline"].append(
                [rank_of(Coord(data=d, pipeline=p, tensor=t), config=config) for p in range(config.pipeline)]
            )
    for p in range(config.pipeline):
        for t in range(config.tensor):
            groups["data"].append(
                [rank_of(Coord(data=d, pipeline=p, tensor=t), config=config) for d in range(data)]
            )
    return groups


class Mesh:
    """The process groups of one rank for one membership round.

    Built after ``init_process_group``; every rank creates every group in the same order, as
    ``new_group`` requires. With a world of one (or no process group at all) every group is ``None`` and
    the parallel layers skip their communication, which is what the single-process reference uses.
    """

    def __init__(self, config: ParallelConfig, *, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.data_size = config.data(world_size)
        self.coord = coord_of(rank, config=config)
        self.tensor_group: dist.ProcessGroup | None = None
        self.pipeline_group: dist.ProcessGroup | None = None
        self.data_group: dist.ProcessGroup | None = None
        self.tensor_ranks = [rank]
        self.pipeline_ranks = [rank]
        self.data_ranks = [rank]
        if world_size == 1 or not dist.is_initialized():
            return
        for kind, all_ranks in group_ranks(config=config, world_size=world_size).items():
            for ranks in all_ranks:
                group: dist.ProcessGroup | None
                if len(ranks) == 1:
                    group = None  # nothing to communicate; every rank skips it alike
                elif len(ranks) == world_size:
                    world = dist.group.WORLD  # spares a group setup, which a regroup waits for
                    assert isinstance(world, dist.ProcessGroup)
                    group = world
                else:
                    # new_group is collective over the whole world, even for groups this rank is not in.
                    group = dist.new_group(ranks)  # type: ignore[assignment]
                if rank in ranks:
                    setattr(self, f"{kind}_group", group)
                    setattr(self, f"{kind}_ranks", ranks)

    def release(self) -> None:
        """Forgets the groups (before ``destroy_process_group``) so nothing keeps their sockets open."""
        self.tensor_group = self.pipeline_group = self.data_group = None

    @property
    def tensor_size(self) -> int:
        return self.config.tensor

    @property
    def pipeline_size(self) -> int:
        return self.config.pipeline

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pipeline == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pipeline == self.config.pipeline - 1

    def next_stage_rank(self) -> int:
        """Global rank of the same tensor shard in the next pipeline stage."""
        return self.pipeline_ranks[self.coord.pipeline + 1]

    def prev_stage_rank(self) -> int:
        """Global rank of the same tensor shard in the previous pipeline stage."""
        return self.pipeline_ranks[self.coord.pipeline - 1]

    def describe(self) -> str:
        c = self.coord
        return (
            f"rank {self.rank}/{self.world_size} data {c.data}/{self.data_size} "
            f"pipeline {c.pipeline}/{self.config.pipeline} tensor {c.tensor}/{self.config.tensor}"
        )
