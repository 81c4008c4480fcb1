"""The reader: :class:`FlashReader` finds the newest step every rank holds, builds DCP's metadata from the
ranks' descriptions, and copies each chunk and value DCP asks for from the snapshot that holds it."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from phalanx.api.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from phalanx.checkpoint import codec, restore
from phalanx.checkpoint.dcp.collectives import all_gather_bytes, decode_descriptions, encode_description
from phalanx.checkpoint.dcp.metadata import Snapshot, build_metadata, snapshot_of, snapshot_problem
from phalanx.checkpoint.dcp.peers import exchange, involving, plan_transfers
from phalanx.checkpoint.dcp.process import checkpointer, warn
from phalanx.checkpoint.dcp.sources import (
    Located,
    Sources,
    committed_on,
    key_of,
    memoryless_like,
    newest_slot,
    peek_description,
)
from phalanx.checkpoint.engine import Checkpointer
from phalanx.checkpoint.structure import MALFORMED


def _narrow(tensor: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _load_chunk(planner: LoadPlanner, item: ReadItem, snapshot: Snapshot) -> None:
    index = item.storage_index
    chunk = snapshot.chunks.get((index.fqn, tuple(index.offset or ())))
    if chunk is None:
        raise CheckpointCorruptError(
            f"{index.fqn}: rank {snapshot.rank}'s snapshot lacks its chunk at {list(index.offset or ())}"
        )
    try:
        source = _narrow(chunk, item.storage_offsets, item.lengths)
    except (RuntimeError, IndexError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{index.fqn}: the chunk does not hold the part asked for: {exc}"
        ) from exc
    target = planner.resolve_tensor(item).detach()
    if target.size() != source.size():
        raise CheckpointCorruptError(
            f"{index.fqn}: the checkpoint holds {list(source.size())} where the state has "
            f"{list(target.size())}"
        )
    with torch.no_grad():
        target.copy_(source)
    planner.commit_tensor(item, target)


def _load_value(planner: LoadPlanner, item: ReadItem, snapshot: Snapshot) -> None:
    fqn = item.storage_index.fqn
    if fqn not in snapshot.values:
        raise CheckpointCorruptError(f"{fqn}: rank {snapshot.rank}'s snapshot lacks this value")
    encoded = io.BytesIO()
    torch.save(snapshot.values[fqn], encoded)  # made and loaded in this process: DCP's planner loads bytes
    encoded.seek(0)
    planner.load_bytes(item, encoded)


def _own_snapshot(ckpt: Checkpointer, seg: Any, step: int) -> dict[str, Any] | None:
    """This rank's snapshot of ``step`` in its node's memory (its slot ``seg``), or None when it holds none or
    an unusable one (a warning)."""
    if seg is None:
        return None
    try:
        meta, tensors = restore.read_memory(seg, step, threads=ckpt.copy_threads)
        state: dict[str, Any] = codec.unflatten(meta["skeleton"], tensors)
        problem = snapshot_problem(state, with_data=True)
    except (CheckpointCorruptError, *MALFORMED) as exc:
        problem = str(exc)
    if problem:
        warn(f"skipping this rank's in-memory snapshot of step {step}: {problem}")
        return None
    return state


_REFUSED = Metadata(state_dict_metadata={})
"""What :meth:`FlashReader.read_metadata` returns for a load it refused (the reason comes next)."""


class FlashReader(StorageReader):
    """A DCP storage reader of the newest step every rank holds, from memory when this node kept it, else
    from storage (see :mod:`phalanx.checkpoint.dcp`). :meth:`locate` finds it; ``dcp.load`` calls it when the
    script did not. Every rank of the default process group must load. One reader per load.

    After the load: ``step``; ``source``, where this rank's snapshot came from ("memory" or "storage");
    ``foreign``, the other ranks' snapshots it read, and from where; ``last_load``, the Checkpointer's
    report (with ``storage_reads``)."""

    def __init__(self, *, checkpointer: Checkpointer | None = None) -> None:
        self._given = checkpointer
        self._located: Located | None = None
        self._searched = False
        self._error: BaseException | None = None
        self.step: int | None = None
        self.source: str | None = None
        self.foreign: dict[int, str] = {}
        self.last_load: dict[str, Any] = {}
        self._sources: Sources | None = None

    def _checkpointer(self) -> Checkpointer:
        return self._given if self._given is not None else checkpointer()

    def locate(self) -> int | None:
        """The step to load, or None when no step is held by every rank. A collective: every rank calls it
        (or ``dcp.load``). It reads this rank's snapshot and gathers every rank's description of its own;
        it raises CheckpointCorruptError, on every rank, when they do not make one whole checkpoint."""
        if not self._searched:
            self._searched = True
            try:
                self._locate()
            except BaseException as exc:
                self._error = exc
                raise
        if self._error is not None:
            raise self._error
        return self.step

    def _locate(self, ckpt: Checkpointer | None = None, memoryless: Path | None = None) -> None:
        ckpt = ckpt if ckpt is not None else self._checkpointer()
        loaded = ckpt.load()
        self.last_load = dict(ckpt.last_load)
        if loaded is None:
            if memoryless is None and restore.distributed():
                self._locate_among_peers(ckpt)
            return
        step, state = loaded
        problem = snapshot_problem(state, with_data=True)
        mine = {"problem": problem, "description": None if problem else encode_description(state)}
        # Every rank sends its description, a broken snapshot its problem: none raises before the others
        # have gathered, so none is left waiting in the collective.
        descriptions = decode_descriptions(all_gather_bytes(json.dumps(mine).encode()), step)
        saves = sorted({(d["world_size"], d["round"]) for d in descriptions})
        if len(saves) > 1 and memoryless is None:
            # A rank killed while it copied step S in a later round keeps step S of an earlier one: the
            # ranks' snapshots of S come from two histories, never to be mixed. The memory of the older
            # steps is overwritten by then; storage commits a step only from one save (see storage).
            warn(
                f"the ranks' snapshots of step {step} in memory come from different saves (world size, "
                f"round: {saves}); loading the newest step committed on storage instead"
            )
            blind, empty = memoryless_like(ckpt)
            try:
                self._locate(blind, empty)
            finally:
                if self._located is None:  # nothing found, or an error: nothing will read through it
                    blind.close()
                    shutil.rmtree(empty, ignore_errors=True)
            if self._located is None:  # every rank alike: they gathered the same descriptions
                raise CheckpointCorruptError(
                    f"the ranks' snapshots of step {step} in memory come from different saves, and storage "
                    "holds no committed step: not starting from scratch"
                )
            return
        saved_by = {rank: int(d["rank"]) for rank, d in enumerate(descriptions)}
        descriptions += self._absent_descriptions(ckpt, step, descriptions)
        metadata = build_metadata(descriptions)
        own = snapshot_of(state)
        self._located = Located(
            step, state["round"], own, metadata, ckpt=ckpt, memoryless=memoryless, saved_by=saved_by
        )
        self.step, self.source = step, self.last_load.get("source")

    def _locate_among_peers(self, ckpt: Checkpointer) -> None:
        """No step is held by every rank: a node was replaced (or its memory lost) and the step was not
        persisted. The newest step any rank holds in its own memory is loaded when the ranks holding it hold
        every tensor whole between them (replicas: HSDP's other replica group, data parallel); the ranks that
        lost theirs then receive what they need from those ranks (see peers). Older steps are tried in turn;
        where none is whole, nothing is loaded, with a warning, as when neither memory nor storage holds a
        step. A collective; every rank decides alike from the same gathered descriptions."""
        segments = ckpt.memory_slots(ckpt.rank)
        held = {seg.header().step for seg in segments if seg.header().complete}
        upper = None
        while (
            step := restore.agree({s for s in held if upper is None or s <= upper}, held_by_any=True)
        ) is not None:
            upper = step - 1
            state = _own_snapshot(ckpt, newest_slot(segments, step), step)
            mine = {"description": None if state is None else encode_description(state)}
            try:
                sent = [
                    json.loads(blob)["description"] for blob in all_gather_bytes(json.dumps(mine).encode())
                ]
                descriptions = {rank: codec.unflatten(d, []) for rank, d in enumerate(sent) if d is not None}
                metadata = build_metadata(list(descriptions.values()), partial=True)
            except (CheckpointCorruptError, ValueError, *MALFORMED) as exc:
                warn(f"step {step}, which only some ranks hold in memory, cannot be loaded: {exc}")
                continue
            own = None if state is None else snapshot_of(state)
            saved_by = {rank: int(d["rank"]) for rank, d in descriptions.items()}
            round_ = int(next(iter(descriptions.values()))["round"])
            self._located = Located(step, round_, own, metadata, ckpt=ckpt, saved_by=saved_by)
            self.step, self.source = step, "memory" if own is not None else "peer"
            self.last_load = {"step": step, "source": self.source, "storage_reads": 0}
            return
        if held:
            warn(
                "no step this rank holds in memory is held whole by the ranks of this world: nothing to load"
            )

    @staticmethod
    def _absent_descriptions(
        ckpt: Checkpointer, step: int, present: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The descriptions of the saving ranks no rank of this world loaded (a smaller world than the one
        that saved): from their slots in this node's memory, else from their manifests on storage."""
        saved = max(int(d.get("world_size", 0)) for d in present)
        absent = sorted(set(range(saved)) - {d.get("rank") for d in present})
        if not absent:
            return []
        committed = committed_on(ckpt.storage)
        found, lacking = [], []
        for rank in absent:
            description = peek_description(ckpt, rank, step, committed)
            if description is None:
                lacking.append(rank)
            else:
                found.append(description)
        if lacking:
            raise CheckpointError(
                f"step {step} was saved by {saved} ranks, and the snapshots of ranks {lacking} are neither "
                "in this node's memory nor on storage"
            )
        return found

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            raise ValueError("FlashReader loads the newest step every rank holds: pass no checkpoint_id")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked from a checkpoint_id: a FlashReader is passed explicitly

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None and self._error is not None:
            # DCP asks for rank-local metadata after the global one failed. torch 2.9 swallows what both calls
            # raise and then fails on a bare `assert metadata is not None`: this empty metadata takes the load
            # on to set_up_storage_reader, which raises the error itself on every torch.
            return _REFUSED
        step = self.locate()
        if step is None or self._located is None:
            self._error = CheckpointNotFoundError(
                "no checkpoint step is held by every rank, in memory or on storage: nothing to load"
            )
            raise self._error
        return self._located.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._error is not None:
            raise self._error
        if self._located is None or metadata is not self._located.metadata:
            raise CheckpointError("FlashReader loads only the metadata its read_metadata returned")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Notes in the plan the chunks and values this rank can read on no snapshot of its node but another
        rank of this world holds in its memory: the coordinator plans their transfers."""
        located = self._located
        if located is None:
            return plan
        self._sources = Sources(located.ckpt, located, self.foreign)
        me = dist.get_rank() if restore.distributed() else 0
        needs = [
            key_of(item.storage_index)
            for item in plan.items
            if self._sources.on_node(item.storage_index) is None
            and any(rank != me for rank in located.senders(item.storage_index))
        ]
        return dataclasses.replace(plan, storage_data={"rank": me, "needs": needs})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On DCP's coordinator: every rank's transfers (see peers), in one order."""
        located = self._located
        asked = [plan.storage_data for plan in plans if isinstance(plan.storage_data, dict)]
        needs = {int(data["rank"]): list(data["needs"]) for data in asked if data.get("needs")}
        if located is None or not needs:
            return plans
        keys = {key for wanted in needs.values() for key in wanted}
        transfers = plan_transfers(needs, {key: located.senders(MetadataIndex(*key)) for key in keys})
        return [
            dataclasses.replace(
                plan, storage_data={"transfers": involving(transfers, plan.storage_data["rank"])}
            )
            if isinstance(plan.storage_data, dict)
            else plan
            for plan in plans
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        located = self._located
        if located is None or located.read:
            raise CheckpointError("this FlashReader has loaded already, or found nothing: make one per load")
        sources = self._sources or Sources(located.ckpt, located, self.foreign)
        transfers = plan.storage_data.get("transfers") if isinstance(plan.storage_data, dict) else None
        try:
            if transfers:
                me = dist.get_rank()
                sources.received = exchange(transfers, me=me, own=located.own)
                for _, src, dst, _ in transfers:
                    if dst == me:
                        self.foreign[located.saved_by[src]] = "peer"
            for item in plan.items:
                snapshot = sources.holding(item.storage_index)
                if item.type == LoadItemType.BYTE_IO:
                    _load_value(planner, item, snapshot)
                else:
                    _load_chunk(planner, item, snapshot)
        finally:
            located.read = True
            located.own = None  # a copy of the whole snapshot: freed once the state holds what it needs
            self._sources = None
            if located.memoryless is not None:
                located.ckpt.close()
                shutil.rmtree(located.memoryless, ignore_errors=True)
        self.last_load["foreign"] = dict(self.foreign)
        done: Future[None] = Future()
        done.set_result(None)
        return done
