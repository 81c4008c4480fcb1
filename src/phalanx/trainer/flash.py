"""The trainer's :class:`~phalanx.trainer.checkpointing.CheckpointSeam` on the flash checkpoint.

A save copies the shard's tensors into node-local shared memory (it blocks only for that copy) and, when
storage is configured, asks the node's checkpoint host to persist the snapshot in the background.

Reconciling two agreement protocols: :meth:`phalanx.checkpoint.Checkpointer.load` agrees on a step by
global rank with its own collectives, but the trainer's recovery plan already agrees on a step per model
shard (data-parallel replicas are identical, and ranks move between coordinates across rounds). So the
Checkpointer's per-rank slots are keyed here by *shard index* (``pipeline * tensor_size + tensor``), with
``world_size`` = number of shards: one saver per shard (the trainer saves from data coordinate 0 only),
and a step is committed on storage when every shard has persisted it. The trainer's plan decides the
step; this adapter only lists what it holds and reads it - from this node's memory when the step is
there (a restarted process on the same node), else from storage. ``Checkpointer.load`` is not used.

The host: with ``PHALANX_CHECKPOINT_*`` in the environment (the node agent owns the host) every process
connects to it; without them local rank 0 starts one (detached, so it outlives a crashed worker and a
restarted one finds its snapshots).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from phalanx.api.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from phalanx.checkpoint import codec, protocol, shm, storage
from phalanx.checkpoint.engine import Checkpointer
from phalanx.checkpoint.restore import read_memory, read_storage
from phalanx.trainer.mesh import ParallelConfig


def shard_index(key: str, *, parallel: ParallelConfig) -> int:
    """The dense index of shard ``pp{p}-tp{t}``: the Checkpointer's slot "rank" for it."""
    p_part, t_part = key.split("-")
    return int(p_part.removeprefix("pp")) * parallel.tensor + int(t_part.removeprefix("tp"))


class FlashCheckpoint:
    """Shard snapshots in node-local shared memory, persisted to ``storage`` every ``persist_every`` saves.

    ``storage`` defaults to ``PHALANX_CHECKPOINT_STORAGE``; without either, snapshots live in memory only
    (they survive worker restarts on this node, not the loss of the node).

    With ``behind`` a save copies while the next step's forward and backward run, and the trainer fences
    it before that step's optimizer update: training stalls only for what the copy has left by then. The
    price: until the fence the newest complete snapshot is the one before, so a process killed outright
    during that forward and backward resumes one step further back than with a blocking save.
    """

    def __init__(
        self,
        *,
        parallel: ParallelConfig,
        storage_location: str | None = None,
        persist_every: int = 1,
        keep_last: int = 2,
        local_rank: int | None = None,
        job_id: str | None = None,
        host_idle_exit_s: float = 300.0,
        behind: bool = False,
    ) -> None:
        self.parallel = parallel
        self.behind = behind
        self.shards = parallel.tensor * parallel.pipeline
        env_storage = os.environ.get(protocol.ENV_STORAGE, "")
        self.storage_location = storage_location if storage_location is not None else env_storage
        self.persist_every = persist_every
        self.keep_last = keep_last
        self.local_rank = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
        self.job_id = job_id
        self.host_idle_exit_s = host_idle_exit_s
        self._by_shard: dict[int, Checkpointer] = {}
        self._saves = 0
        self.last_source = ""
        """Where the last :meth:`load` read from: "memory" or "storage"."""
        self.last_save_s = 0.0
        """How long the last :meth:`save` blocked (the memory copy)."""
        if self.local_rank == 0 and protocol.ENV_SOCKET not in os.environ:
            # Start the node's host now: a saver on another local rank only connects, never starts one.
            self._checkpointer(0).client()

    def _checkpointer(self, index: int) -> Checkpointer:
        ckpt = self._by_shard.get(index)
        if ckpt is None:
            ckpt = Checkpointer(
                storage=self.storage_location,
                keep_last=self.keep_last,
                rank=index,
                world_size=self.shards,
                local_rank=self.local_rank,
                job_id=self.job_id,
                host_idle_exit_s=self.host_idle_exit_s,
            )
            self._by_shard[index] = ckpt
        return ckpt

    def _ckpt(self, key: str) -> Checkpointer:
        return self._checkpointer(shard_index(key, parallel=self.parallel))

    def prepare(self, *, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Allocates and maps the shard's two slots in the background (the host sizes them, a thread of
        this process populates them), so the first :meth:`save` is a plain memory copy."""
        self._ckpt(key).prepare({k: v.detach() for k, v in tensors.items()})

    def save(self, *, step: int, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
        """Copies the shard into shared memory; persisting (if configured) continues in the background.
        Returns whether the save had to allocate the memory (it was not prepared) and whether it persists."""
        ckpt = self._ckpt(key)
        self._saves += 1
        persist = (
            ckpt.storage is not None and self.persist_every > 0 and self._saves % self.persist_every == 0
        )
        ckpt.save(
            step, {k: v.detach() for k, v in tensors.items()}, persist=persist, blocking=not self.behind
        )
        self.last_save_s = float(ckpt.last_save.get("seconds", 0.0))
        return {"allocated": bool(ckpt.last_save.get("allocated")), "persist": persist, "behind": self.behind}

    def fence(self) -> None:
        """Waits for the saves still copying behind training (see ``behind``)."""
        for ckpt in self._by_shard.values():
            ckpt.fence()

    def _memory(self, ckpt: Checkpointer) -> dict[int, shm.Segment]:
        steps: dict[int, shm.Segment] = {}
        for seg in ckpt.memory_slots(ckpt.rank):
            header = seg.header()
            if header.complete and (header.step not in steps or header.seq > steps[header.step].header().seq):
                steps[header.step] = seg
        return steps

    def steps(self, *, key: str) -> list[int]:
        """Steps of the shard in this node's memory or committed on storage, newest first."""
        ckpt = self._ckpt(key)
        ckpt.fence()  # a snapshot still copying is listed once it is complete
        found = set(self._memory(ckpt))
        if ckpt.storage is not None:
            found |= set(storage.committed_steps(ckpt.storage))
        return sorted(found, reverse=True)

    def load(
        self, *, step: int, key: str, into: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The shard at ``step``: from memory when this node holds it intact (copied straight into the
        tensors of ``into`` that match by name, dtype and shape), else from storage."""
        ckpt = self._ckpt(key)
        ckpt.fence()  # ``into`` may be the very tensors a save behind training still reads
        got: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        problems: list[str] = []
        seg = self._memory(ckpt).get(step)
        if seg is not None:
            try:
                got = read_memory(seg, step, into=into, threads=ckpt.copy_threads)
                self.last_source = "memory"
            except CheckpointCorruptError as exc:
                problems.append(str(exc))
        if got is None and ckpt.storage is not None and step in storage.committed_steps(ckpt.storage):
            try:
                got = read_storage(ckpt.storage, step, ckpt.rank, threads=ckpt.copy_threads)
                self.last_source = "storage"
            except CheckpointCorruptError as exc:
                problems.append(str(exc))
        if got is None:
            if problems:
                raise CheckpointCorruptError(f"shard {key} step {step}: {'; '.join(problems)}")
            raise CheckpointNotFoundError(f"no snapshot of shard {key} at step {step} in memory or storage")
        meta, tensors = got
        state = codec.unflatten(meta["skeleton"], tensors)
        if not isinstance(state, dict):
            raise CheckpointCorruptError(f"shard {key} step {step}: not a tensor dictionary")
        return state

    def close(self, *, wait_s: float | None = 60.0) -> None:
        """Waits for this process's pending persistence (raising PersistError if it failed) and unmaps."""
        try:
            for ckpt in self._by_shard.values():
                ckpt.wait(timeout_s=wait_s)
        finally:
            for ckpt in self._by_shard.values():
                with contextlib.suppress(CheckpointError, OSError):
                    ckpt.close()
            self._by_shard.clear()
