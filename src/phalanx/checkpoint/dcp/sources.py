"""Other ranks' snapshots, for the chunks and values this rank's own lacks (the world or the sharding
changed, or its node was replaced): from this node's memory, else what a peer sent (see peers), else from
storage; and a Checkpointer that sees storage only, for when the ranks' snapshots in memory come from
different saves."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from phalanx.api.errors import CheckpointCorruptError, CheckpointError
from phalanx.checkpoint import codec, restore, shm, storage
from phalanx.checkpoint.dcp.metadata import Snapshot, description_of_meta, snapshot_of, snapshot_problem
from phalanx.checkpoint.dcp.peers import Key
from phalanx.checkpoint.dcp.process import warn
from phalanx.checkpoint.engine import Checkpointer
from phalanx.checkpoint.structure import MALFORMED, meta_problem


def newest_slot(segments: list[shm.Segment], step: int) -> shm.Segment | None:
    """The slot holding a complete snapshot of ``step`` (the newer one when both do)."""
    holding = [seg for seg in segments if seg.header().complete and seg.header().step == step]
    return max(holding, key=lambda seg: seg.header().seq, default=None)


def committed_on(store: storage.Storage | None) -> set[int]:
    """The steps committed on ``store``: none without storage, or when it cannot be listed (a warning)."""
    if store is None:
        return set()
    try:
        return set(storage.committed_steps(store))
    except OSError as exc:
        warn(f"cannot list the checkpoints on {store.url('')}: {exc}")
        return set()


class _Slots:
    """Another rank's slots on this node, mapped for as long as they are read."""

    def __init__(self, ckpt: Checkpointer, rank: int) -> None:
        self._own = rank == ckpt.rank  # this rank's own slots stay mapped: its Checkpointer owns them
        self.segments = ckpt.memory_slots(rank)

    def __enter__(self) -> list[shm.Segment]:
        return self.segments

    def __exit__(self, *exc: object) -> None:
        if not self._own:
            for seg in self.segments:
                seg.close()


def peek_description(ckpt: Checkpointer, rank: int, step: int, committed: set[int]) -> dict[str, Any] | None:
    """The description of ``rank``'s snapshot of ``step`` from its metadata alone: in this node's memory,
    else on storage when ``step`` is committed there; None when neither holds it."""
    with _Slots(ckpt, rank) as segments:
        seg = newest_slot(segments, step)
        if seg is not None:
            header = seg.header()
            try:
                meta = json.loads(bytes(seg.buf[shm.HEADER_SIZE : shm.HEADER_SIZE + header.meta_len]))
                problem = meta_problem(meta)
                if not problem:
                    return description_of_meta(meta)
                warn(f"the in-memory snapshot of rank {rank} of step {step} is malformed: {problem}")
            except (CheckpointCorruptError, ValueError, *MALFORMED) as exc:
                warn(f"the in-memory snapshot of rank {rank} of step {step} is unreadable: {exc}")
    if ckpt.storage is None or step not in committed:
        return None
    path = storage.manifest_file(step, rank)
    try:
        manifest = json.loads(ckpt.storage.read(path))
        return description_of_meta(manifest["meta"])
    except (CheckpointCorruptError, OSError, ValueError, *MALFORMED) as exc:
        raise CheckpointCorruptError(f"{ckpt.storage.url(path)}: unusable manifest: {exc}") from exc


def memoryless_like(ckpt: Checkpointer) -> tuple[Checkpointer, Path]:
    """A Checkpointer of the same rank and job that sees no memory (an empty shared-memory root): it loads
    from storage only, as a new node would."""
    if ckpt.storage is None:
        raise CheckpointCorruptError(
            "the ranks' snapshots in memory come from different saves, and there is no storage to load from"
        )
    empty = Path(tempfile.mkdtemp(prefix="phalanx-dcp-no-memory-"))
    blind = Checkpointer(
        storage=ckpt.storage_location,
        rank=ckpt.rank,
        world_size=ckpt.world_size,
        local_rank=ckpt.local_rank,
        job_id=ckpt.job_id,
        shm_dir=str(empty),
        host_socket=ckpt.host_socket,
    )
    return blind, empty


def key_of(index: MetadataIndex) -> Key:
    """How a snapshot names the chunk or value ``index`` points to."""
    return (index.fqn, tuple(index.offset) if index.offset is not None else None)


def _holds(snapshot: Snapshot, index: MetadataIndex) -> bool:
    fqn, offsets = key_of(index)
    return (fqn, offsets) in snapshot.chunks if offsets is not None else fqn in snapshot.values


@dataclasses.dataclass
class Located:
    """The step a :class:`FlashReader` loads, with this rank's snapshot of it and DCP's metadata."""

    step: int
    round: int
    own: Snapshot | None  # None for a rank whose snapshot was lost (its node was); dropped once read
    metadata: Metadata
    ckpt: Checkpointer  # the one it was found with, which reads the other ranks' snapshots
    memoryless: Path | None = None  # the empty shared-memory root of a load from storage only
    saved_by: dict[int, int] = dataclasses.field(default_factory=dict)
    """Whose snapshot each rank of this world holds in its memory (rank -> the saving rank): the ranks
    that can send a part of it to a rank that lacks it (see peers)."""
    read: bool = False

    def senders(self, index: MetadataIndex) -> list[int]:
        """The ranks of this world that hold ``index`` in their own snapshot."""
        holders = set(self.metadata.storage_data.get(index, []))
        return [rank for rank, saver in sorted(self.saved_by.items()) if saver in holders]


class Sources:
    """Where this rank reads each chunk and value of the step: its own snapshot, else the snapshot of a rank
    that holds it in this node's memory (read whole and verified), else what a rank on another node sent it
    (``received``, see peers), else the snapshot of a rank that holds it on storage; each snapshot read at
    most once. ``foreign`` records which ranks' snapshots were read, and from where."""

    def __init__(self, ckpt: Checkpointer, located: Located, foreign: dict[int, str]) -> None:
        self._ckpt = ckpt
        self._located = located
        self._foreign = foreign
        self._memory: dict[int, Snapshot | None] = {}
        self._storage: dict[int, Snapshot | None] = {}
        self._why: dict[int, str] = {}
        self._committed: set[int] | None = None
        self.received: Snapshot | None = None

    def on_node(self, index: MetadataIndex) -> Snapshot | None:
        """The snapshot on this node that holds ``index``: this rank's own, else another rank's in this node's
        memory; None when neither does."""
        holders: list[int] = self._located.metadata.storage_data.get(index, [])
        own = self._located.own
        if own is not None and own.rank in holders:
            return own
        for rank in holders:
            if rank not in self._memory:
                self._memory[rank] = self._from_memory(rank)
            if self._memory[rank] is not None:
                return self._memory[rank]
        return None

    def holding(self, index: MetadataIndex) -> Snapshot:
        found = self.on_node(index)
        if found is not None:
            return found
        received = self.received
        if received is not None and _holds(received, index):
            return received
        holders: list[int] = self._located.metadata.storage_data.get(index, [])
        for rank in holders:
            if rank not in self._storage:
                self._storage[rank] = self._from_storage(rank)
            stored = self._storage[rank]
            if stored is not None:
                return stored
        where = f"{index.fqn}" + (f" (chunk at {list(index.offset)})" if index.offset is not None else "")
        if not holders:
            raise CheckpointCorruptError(f"{where}: no snapshot of step {self._located.step} holds it")
        raise CheckpointError(
            f"{where}: only the snapshots of ranks {holders} of step {self._located.step} hold it, and none "
            f"can be read here ({'; '.join(f'rank {r}: {self._why[r]}' for r in holders)}); a chunk no rank "
            "of this world holds in memory is read from storage, once the step is persisted "
            "(FlashWriter(persist=True))"
        )

    def _usable(self, state: Any, rank: int, where: str) -> Snapshot:
        problem = snapshot_problem(state, with_data=True)
        if not problem and (state["rank"], state["round"]) != (rank, self._located.round):
            problem = f"it is rank {state['rank']}'s of round {state['round']}, not rank {rank}'s of the save"
        if problem:
            raise CheckpointCorruptError(problem)
        self._foreign[rank] = where
        return snapshot_of(state)

    def _from_memory(self, rank: int) -> Snapshot | None:
        step = self._located.step
        with _Slots(self._ckpt, rank) as segments:
            seg = newest_slot(segments, step)
            if seg is None:
                self._why[rank] = "not in this node's memory"
                return None
            try:
                meta, tensors = restore.read_memory(seg, step, threads=self._ckpt.copy_threads)
                return self._usable(codec.unflatten(meta["skeleton"], tensors), rank, "memory")
            except (CheckpointCorruptError, *MALFORMED) as exc:
                self._why[rank] = f"its in-memory snapshot is unusable: {exc}"
                warn(f"skipping rank {rank}'s in-memory snapshot of step {step}: {exc}")
                return None

    def _from_storage(self, rank: int) -> Snapshot | None:
        step, store = self._located.step, self._ckpt.storage
        if self._committed is None:
            self._committed = committed_on(store)
        if store is None or step not in self._committed:
            self._why[rank] = self._why.get(rank, "") + f"; step {step} is not on storage"
            return None
        try:
            meta, tensors = restore.read_storage(store, step, rank, threads=self._ckpt.copy_threads)
            return self._usable(codec.unflatten(meta["skeleton"], tensors), rank, "storage")
        except (CheckpointCorruptError, *MALFORMED) as exc:
            self._why[rank] = self._why.get(rank, "") + f"; its persisted shard is unusable: {exc}"
            return None
