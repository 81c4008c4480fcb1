"""Tensor, pipeline and data parallel GPT training that re-forms its process groups in-process when
membership changes.

The public surface: the configs, the model, the engine of one rank, the elastic loop and the checkpoint
seam with its two implementations (files, and the flash checkpoint). Everything else (communication
regions, schedules, recovery planning) is importable from its module but is not a promise.
"""

from __future__ import annotations

from phalanx.trainer.checkpointing import CheckpointSeam, FileCheckpoint
from phalanx.trainer.elastic import RESTART_EXIT_CODE, ElasticConfig, ElasticTrainer
from phalanx.trainer.engine import Engine, OptimConfig
from phalanx.trainer.flash import FlashCheckpoint
from phalanx.trainer.mesh import Mesh, ParallelConfig
from phalanx.trainer.model import GPTConfig, GPTStage

__all__ = [
    "RESTART_EXIT_CODE",
    "CheckpointSeam",
    "ElasticConfig",
    "ElasticTrainer",
    "Engine",
    "FileCheckpoint",
    "FlashCheckpoint",
    "GPTConfig",
    "GPTStage",
    "Mesh",
    "OptimConfig",
    "ParallelConfig",
]
