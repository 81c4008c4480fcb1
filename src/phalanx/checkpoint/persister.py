"""Persisting one rank's in-memory snapshot to storage (torch-free; runs in the checkpoint host).

The tensor bytes go from the shared-memory slot straight into a safetensors file (8-byte little-endian
header length, JSON header, raw data), so the host needs no torch. The crc32 of the whole file is
computed while writing and recorded in the shard manifest, and in the slot header so a process that
reloads the slot from memory can check it too.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from phalanx.api.errors import PersistError
from phalanx.checkpoint import shm, storage
from phalanx.checkpoint.storage import SAFETENSORS_DTYPES, Storage

log = logging.getLogger("phalanx.checkpoint")


@dataclass(frozen=True)
class PersistResult:
    """What persisting one shard achieved."""

    step: int
    rank: int
    world_size: int
    path: str
    size_bytes: int
    duration_s: float
    committed: bool
    not_committed: str = ""
    """Why the step was not committed although every rank's shard is there (shards of different saves)."""


def read_meta(seg: shm.Segment, header: shm.SlotHeader) -> dict[str, Any]:
    """The JSON metadata of a slot."""
    meta = json.loads(bytes(seg.buf[shm.HEADER_SIZE : shm.HEADER_SIZE + header.meta_len]))
    if not isinstance(meta, dict):
        raise ValueError("slot metadata is not a JSON object")
    return meta


def safetensors_header(meta: dict[str, Any]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding the slot's tensors, packed."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "phalanx"}}
    offset = 0
    for t in meta["tensors"]:
        code = SAFETENSORS_DTYPES.get(t["dtype"])
        if code is None:
            raise PersistError(f"tensor {t['name']} has dtype {t['dtype']}, which safetensors cannot hold")
        entries[t["name"]] = {
            "dtype": code,
            "shape": t["shape"],
            "data_offsets": [offset, offset + t["nbytes"]],
        }
        offset += t["nbytes"]
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data section starts 8-byte aligned
    return len(body).to_bytes(8, "little") + body


class Superseded(PersistError):
    """A newer save took the slot of a snapshot that waited to be persisted (storage is slower than the
    persist interval). Nothing is lost: the newer step is persisted at its own turn."""


def choose_slot(segments: list[shm.Segment], step: int | None) -> tuple[shm.Segment, shm.SlotHeader] | None:
    """The slot holding ``step`` (or the newest complete snapshot when ``step`` is None)."""
    best: tuple[shm.Segment, shm.SlotHeader] | None = None
    for seg in segments:
        header = seg.header()
        if not header.complete or (step is not None and header.step != step):
            continue
        if best is None or header.step > best[1].step:
            best = (seg, header)
    return best


def pin_queued(segments: list[shm.Segment], step: int) -> shm.Segment | None:
    """Pins the slot holding ``step`` while its persist waits in the host's queue, so that later saves go
    to the other slot (see the Checkpointer's slot choice); returns it. A slot the persister is reading
    keeps its stronger pin."""
    pinned = None
    for seg in segments:
        header = seg.header()
        if header.complete and header.step == step:
            pinned = seg
            if header.pin == 0:
                shm.set_pin(seg.buf, shm.PIN_QUEUED)
    return pinned


def persist_shard(
    *, segments: list[shm.Segment], store: Storage, step: int | None, keep_last: int
) -> PersistResult:
    """Writes the rank's snapshot of ``step`` to storage and commits the step if it completes it.

    Raises PersistError (disk full, permissions, snapshot overwritten while reading); a failure leaves
    no file under a final name and never touches the memory snapshot.
    """
    started = time.monotonic()
    chosen = choose_slot(segments, step)
    if chosen is None:
        # A newer save took the slot; it may still be copying (a save behind training, whose copy on a
        # GPU can outlast several short steps), so a slot being written counts as newer too.
        newer = [h.step for h in (seg.header() for seg in segments) if h.state != shm.STATE_EMPTY]
        if step is not None and newer and max(newer) > step:
            raise Superseded(f"step {step} was superseded by step {max(newer)} before it was persisted")
        raise PersistError(f"no complete in-memory snapshot of step {step} to persist")
    seg, header = chosen
    shm.set_pin(seg.buf, shm.PIN_WRITING)  # no save may take this slot until it is persisted
    try:
        if seg.header().seq != header.seq:
            raise Superseded(f"step {header.step} was superseded by a newer save before it was persisted")
        meta = read_meta(seg, header)
        save = meta.get("save")
        if isinstance(save, dict) and save.get("job"):  # the job's first persist claims the root
            try:
                storage.claim(
                    store,
                    job=str(save["job"]),
                    uid=str(save.get("uid", "")),
                    resumed_from=meta.get("resumed_from"),
                )
            except OSError as exc:
                raise PersistError(f"checking who owns {store.url('')} failed: {exc}") from exc
        head = safetensors_header(meta)
        crc = 0

        def chunks() -> Iterator[bytes | memoryview]:
            nonlocal crc
            crc = zlib.crc32(head, crc)
            yield head
            view = memoryview(seg.buf)
            try:
                for t in meta["tensors"]:
                    start = header.data_off + t["offset"]
                    part = view[start : start + t["nbytes"]]
                    crc = zlib.crc32(part, crc)
                    yield part
                    part.release()
            finally:
                view.release()

        rank = header.rank
        file = storage.shard_file(header.step, rank)
        try:
            size = store.write_atomic(file, chunks())
        except OSError as exc:
            raise PersistError(f"writing {store.url(file)} failed: {exc}") from exc
        if seg.header().seq != header.seq:  # a save that read the pin just before it was set
            raise Superseded(f"step {header.step} was superseded by a newer save while it was persisted")
        shm.set_crc(seg.buf, crc=crc, seq=header.seq)
        manifest = {
            "step": header.step,
            "rank": rank,
            "world_size": header.world_size,
            "file": file.rsplit("/", 1)[-1],
            "size": size,
            "crc32": crc,
            "save": save,
            "meta": meta,
        }
        not_committed = ""
        try:
            store.write_atomic(storage.manifest_file(header.step, rank), [json.dumps(manifest).encode()])
            try:
                committed = storage.try_commit(store, step=header.step, world_size=header.world_size)
            except storage.MixedSaveError as exc:
                # Not this shard's failure: the ranks of this save may still overwrite the others' shards.
                committed, not_committed = False, str(exc)
                log.error("%s", exc)
            if committed:
                storage.apply_retention(store, keep_last=keep_last)
        except OSError as exc:
            raise PersistError(f"writing the manifest of step {header.step} failed: {exc}") from exc
    finally:
        shm.set_pin(seg.buf, 0)
    return PersistResult(
        step=header.step,
        rank=rank,
        world_size=header.world_size,
        path=store.url(storage.step_dir(header.step)),
        size_bytes=size,
        duration_s=time.monotonic() - started,
        committed=committed,
        not_committed=not_committed,
    )
