"""The seam between the trainer and checkpoint storage.

The trainer needs three things from a checkpoint: save this shard's tensors at a step, list the steps it
could load for a shard, and load one. :class:`CheckpointSeam` is that interface; :class:`FileCheckpoint`
implements it on a directory (safetensors for tensors, atomic rename so a crash never leaves a partial
file under a final name). The node-local flash checkpoint of :mod:`phalanx.checkpoint` plugs in behind the
same three methods: :class:`phalanx.trainer.flash.FlashCheckpoint`, the default of the GPT example.

Shards are keyed by mesh coordinate (``pp{p}-tp{t}``), not by rank: data-parallel replicas are identical,
so any replica's file restores a shard, whichever rank now sits at that coordinate.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file

from phalanx.api.errors import CheckpointCorruptError, CheckpointNotFoundError


class CheckpointSeam(Protocol):
    """Where the trainer saves and finds shard snapshots."""

    last_source: str
    """Where the last ``load`` read from ("file", "memory", "storage"), for the trainer's events."""

    def prepare(self, *, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Readies the memory for saves of shard ``key`` shaped like ``tensors``, off the training path,
        so the first save costs what every later one does. Returns at once."""

    def save(self, *, step: int, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
        """Stores ``tensors`` as shard ``key`` of ``step``; returns facts about the save for the trainer's
        ``checkpoint`` event (may be empty). It may go on reading ``tensors`` after it returns, until
        :meth:`fence`."""

    def fence(self) -> None:
        """Returns once no save reads its tensors any more; the trainer calls it before it changes them
        (the optimizer step, a load, a broadcast from a peer). Raises CheckpointError when such a save
        failed (its snapshot is then not used; the one before it stays the newest)."""

    def steps(self, *, key: str) -> list[int]:
        """Steps of shard ``key`` that can be loaded, newest first."""

    def load(
        self, *, step: int, key: str, into: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The tensors of shard ``key`` at ``step``; an implementation may fill the matching tensors of
        ``into`` in place and return them (the caller copies whatever it gets back)."""


def shard_key(*, pipeline: int, tensor: int) -> str:
    """The name of one model shard, shared by all its data-parallel replicas."""
    return f"pp{pipeline}-tp{tensor}"


class FileCheckpoint:
    """Shard snapshots as safetensors files under one directory, keeping the newest ``keep`` steps."""

    def __init__(self, root: Path, *, keep: int = 2) -> None:
        self.root = root
        self.keep = keep
        self.last_source = "file"

    def _path(self, key: str, step: int) -> Path:
        return self.root / key / f"step-{step:010d}.safetensors"

    def prepare(self, *, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Nothing to ready: a file is written whole at each save."""

    def fence(self) -> None:
        """Nothing to wait for: :meth:`save` writes the file before it returns."""

    def save(self, *, step: int, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
        path = self._path(key, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
        tmp.replace(path)
        for old in self.steps(key=key)[self.keep :]:
            self._path(key, old).unlink(missing_ok=True)
        return {"path": str(path)}

    def steps(self, *, key: str) -> list[int]:
        folder = self.root / key
        if not folder.is_dir():
            return []
        found = []
        for entry in folder.iterdir():
            name = entry.name
            if name.startswith("step-") and name.endswith(".safetensors"):
                found.append(int(name[len("step-") : -len(".safetensors")]))
        return sorted(found, reverse=True)

    def load(
        self, *, step: int, key: str, into: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        del into  # read whole from the file; the caller copies
        path = self._path(key, step)
        if not path.exists():
            raise CheckpointNotFoundError(f"no checkpoint of shard {key} at step {step} under {self.root}")
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types for truncated or bad files
            raise CheckpointCorruptError(f"checkpoint {path} cannot be read; delete it to fall back") from exc
