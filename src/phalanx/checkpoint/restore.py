"""Loading: every rank agrees on the newest step all of them hold, then each reads it from shared memory
when its node kept it, else from storage (or receives it from a replica that read it). State that every rank
saves alike (``replicated``, data parallel) is loaded at the newest step any rank holds: a rank whose node
lost it, or a replacement node that never had it, receives it from the lowest rank holding it.

Agreement uses integer all-reduces only (no pickled objects): propose the minimum over ranks of each
rank's newest candidate, accept it when every rank holds it, else lower the bound and repeat. A snapshot
that fails its checksum is dropped on every rank, with a warning naming it, and the next older common
step is tried; :class:`~phalanx.api.errors.CheckpointCorruptError` is raised when nothing valid remains.
A manifest or snapshot of the wrong structure (truncated JSON, a missing key, a wrong type: see
:mod:`phalanx.checkpoint.structure`) counts as corrupt the same way, and is found before the ranks vote on
it: never an exception on one rank while the others wait in a collective.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.api.errors import CheckpointCorruptError, CheckpointError
from phalanx.checkpoint import codec, crc, shm, storage
from phalanx.checkpoint.persister import safetensors_header
from phalanx.checkpoint.structure import MALFORMED, manifest_problem, meta_problem

log = logging.getLogger("phalanx.checkpoint")

LIST_LIMIT_S = 10.0  # longest a load with snapshots in memory waits for storage to list its steps


@dataclass(frozen=True)
class LoadSource:
    """What a load reads: this node's memory and the job's storage, and who loads (the job's name)."""

    storage: storage.Storage | None
    memory_slots: Callable[[int], list[shm.Segment]]
    """A rank's mapped slots on this node ([] when there are none)."""
    shm_dir: Path
    job_id: str  # the node's job id, which names the slots
    job_name: str  # the job's name, to tell when a step on storage was committed by another job
    copy_threads: int  # threads a read and its checksum may use


@dataclass(frozen=True)
class LoadReport:
    """What a load found: ``loaded`` is ``(step, state)`` or None; ``source`` says where it came from
    ("memory", "storage" or "peer"); ``resumed_from`` is ``{"job", "step"}`` when the step was committed by
    another job, which this one continues (see storage.claim_decision)."""

    loaded: tuple[int, Any] | None
    source: str | None = None
    storage_reads: int = 0
    seconds: float | None = None
    resumed_from: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        """The report as ``Checkpointer.last_load`` shows it."""
        if self.loaded is None:
            return {"step": None, "source": None, "storage_reads": 0}
        return {
            "step": self.loaded[0],
            "source": self.source,
            "storage_reads": self.storage_reads,
            "seconds": self.seconds,
        }


class CheckpointWarning(UserWarning):
    """A snapshot was skipped because it failed its checksum or structure check, or storage could not be
    listed and the memory snapshots were used without it."""


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def distributed() -> bool:
    """Whether this process is in an initialised default process group."""
    return dist.is_available() and dist.is_initialized()


def collective_device() -> torch.device:
    """Where a collective's tensors go: the current GPU under NCCL, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def _all_reduce(value: int, op: Any, group: Any = None) -> int:
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=op, group=group)
    return int(t.item())


def agree(candidates: set[int], *, held_by_any: bool = False) -> int | None:
    """The newest step in every rank's candidate set (None when there is none). ``held_by_any``: the newest
    step in any rank's set, for replicated state, which a rank holding it hands to the others."""
    if held_by_any:
        newest = _all_reduce(max(candidates, default=-1), dist.ReduceOp.MAX if distributed() else None)
        return newest if newest >= 0 else None
    upper = 2**62
    while True:
        mine = max((c for c in candidates if c <= upper), default=-1)
        proposal = _all_reduce(mine, dist.ReduceOp.MIN if distributed() else None)
        if proposal < 0:
            return None
        if _all_reduce(int(proposal in candidates), dist.ReduceOp.MIN if distributed() else None):
            return proposal
        upper = proposal - 1


# ---------------------------------------------------------------------------------------------------
# Reading one shard


def _memory_steps(segments: list[shm.Segment]) -> dict[int, shm.Segment]:
    steps: dict[int, shm.Segment] = {}
    for seg in segments:
        header = seg.header()
        if header.complete and (header.step not in steps or header.seq > steps[header.step].header().seq):
            steps[header.step] = seg
    return steps


def _fits(dst: torch.Tensor | None, entry: dict[str, Any]) -> bool:
    """Whether a snapshot tensor can be copied straight into ``dst`` (loading in place)."""
    return (
        dst is not None
        and dst.device.type == "cpu"
        and dst.is_contiguous()
        and str(dst.dtype).removeprefix("torch.") == entry["dtype"]
        and list(dst.shape) == entry["shape"]
    )


def read_memory(
    seg: shm.Segment, step: int, *, into: Mapping[str, torch.Tensor] | None = None, threads: int = 1
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Copies a snapshot out of a slot, verifying its checksum when the host recorded one.

    ``into`` maps tensor names (as :func:`codec.flatten` names them) to tensors to fill in place: a tensor
    of the same dtype and shape is copied into and returned as itself, which spares allocating (and
    first-touching) fresh memory and the caller's second copy. On an error they hold partial data. The
    checksum runs on ``threads`` threads beside the copies (it costs far more than they do).
    """
    header = seg.header()
    if not header.complete or header.step != step:
        raise CheckpointCorruptError(f"{seg.path}: the snapshot of step {step} was overwritten")
    try:
        meta = json.loads(bytes(seg.buf[shm.HEADER_SIZE : shm.HEADER_SIZE + header.meta_len]))
    except ValueError as exc:
        raise CheckpointCorruptError(f"{seg.path}: unreadable metadata: {exc}") from exc
    problem = meta_problem(meta)
    if (
        problem
        or header.data_off + max((e["offset"] + e["nbytes"] for e in meta["tensors"]), default=0) > seg.size
    ):
        raise CheckpointCorruptError(f"{seg.path}: malformed snapshot of step {step}: {problem or 'too big'}")
    check = header.crc_seq == header.seq
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-verify") as verifier:
        checksum = None
        if check:
            slot = memoryview(seg.buf)
            ranges = [(header.data_off + e["offset"], e["nbytes"]) for e in meta["tensors"]]
            parts: list[crc.Bytes] = [safetensors_header(meta), *(slot[a : a + n] for a, n in ranges)]
            checksum = verifier.submit(crc.crc32, parts, threads=threads)
            del parts, slot  # the pool holds them until it is done; the mapping must be closable after
        view = torch.frombuffer(seg.buf, dtype=torch.uint8)
        tensors = []
        for entry in meta["tensors"]:
            start = header.data_off + entry["offset"]
            raw = view[start : start + entry["nbytes"]]
            dst = into.get(entry["name"]) if into is not None else None
            if dst is not None and _fits(dst, entry):
                with torch.no_grad():
                    dst.view(-1).view(torch.uint8).copy_(raw)
                tensors.append(dst)
            else:
                tensors.append(raw.clone().view(codec.DTYPES[entry["dtype"]]).view(entry["shape"]))
        del view
        computed = checksum.result() if checksum is not None else None
    if seg.header().seq != header.seq:
        raise CheckpointCorruptError(f"{seg.path}: the snapshot of step {step} changed while it was read")
    if check and computed != header.crc:
        raise CheckpointCorruptError(
            f"{seg.path}: checksum mismatch in the in-memory snapshot of step {step}"
        )
    return meta, tensors


def _fill(
    targets: Mapping[str, torch.Tensor], entries: list[dict[str, Any]], tensors: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Copies loaded tensors into the matching ``targets`` not filled in place yet; returns the list with
    those targets in their place."""
    out = []
    for entry, loaded in zip(entries, tensors, strict=True):
        dst = targets.get(entry["name"])
        if dst is None or dst is loaded or not _fits(dst, entry):
            out.append(loaded)
            continue
        with torch.no_grad():
            dst.copy_(loaded)
        out.append(dst)
    return out


def stored_shard(store: storage.Storage, step: int, rank: int) -> int:
    """The persisted shard ``rank`` reads: its own, or, when the job has grown since ``step`` was saved by
    fewer ranks, ``rank % saved ranks``: the ranks that can change with membership are data-parallel
    replicas of the same state (model-parallel shards are keyed by mesh coordinate, not rank)."""
    if store.exists(storage.manifest_file(step, rank)):
        return rank
    saved = storage.committed_world_size(store, step)
    if 0 < saved <= rank:
        log.info(
            "rank %d loads the shard of rank %d: step %d was saved by %d ranks",
            rank,
            rank % saved,
            step,
            saved,
        )
        return rank % saved
    return rank


def read_storage(
    store: storage.Storage, step: int, rank: int, *, threads: int = 1
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Reads a persisted shard and checks its size and crc32 (on ``threads`` threads) against the
    manifest."""
    manifest_path = storage.manifest_file(step, rank)
    file = storage.shard_file(step, rank)
    try:
        manifest = json.loads(store.read(manifest_path))
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{store.url(manifest_path)}: cannot read the shard: {exc}") from exc
    problem = manifest_problem(manifest)
    if problem:
        raise CheckpointCorruptError(f"{store.url(manifest_path)}: malformed manifest: {problem}")
    try:
        data = bytearray(store.read(file))
    except OSError as exc:
        raise CheckpointCorruptError(f"{store.url(file)}: cannot read the shard: {exc}") from exc
    if len(data) != manifest["size"] or crc.crc32([data], threads=threads) != manifest["crc32"]:
        raise CheckpointCorruptError(f"{store.url(file)}: checksum mismatch (the file is corrupt)")
    try:
        return _decode_shard(data, manifest["meta"])
    except MALFORMED as exc:  # a manifest that passed its checks but does not match its file
        raise CheckpointCorruptError(
            f"{store.url(file)}: the shard does not match its manifest: {exc}"
        ) from exc


def _decode_shard(data: bytearray, meta: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    header_len = int.from_bytes(data[:8], "little")
    entries = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    tensors = []
    for entry in meta["tensors"]:
        begin, end = entries[entry["name"]]["data_offsets"]
        dtype = codec.DTYPES[entry["dtype"]]
        raw = (
            torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=base + begin)
            if end > begin
            else None
        )
        if raw is None:
            tensors.append(torch.empty(entry["shape"], dtype=dtype))
        elif (base + begin) % dtype.itemsize == 0:  # aligned: view the read buffer, no second copy
            tensors.append(raw.view(dtype).view(entry["shape"]))
        else:
            tensors.append(raw.clone().view(dtype).view(entry["shape"]))
    return meta, tensors


# ---------------------------------------------------------------------------------------------------
# Replicas: one reads, the others receive


def _broadcast_shard(
    got: tuple[dict[str, Any], list[torch.Tensor]] | None, *, src: int, group: Any
) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
    device = collective_device()
    is_src = dist.get_rank() == src
    status = torch.tensor([1 if got is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(status, src=src, group=group)
    if not int(status.item()):
        return None
    if is_src:
        assert got is not None
        blob = json.dumps(got[0]).encode()
        length = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    buf = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        if is_src
        else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src=src, group=group)
    meta = got[0] if is_src and got is not None else json.loads(bytes(buf.cpu().numpy()))
    tensors = []
    for i, entry in enumerate(meta["tensors"]):
        if is_src and got is not None:
            t = got[1][i].contiguous().to(device)
        else:
            t = torch.empty(entry["shape"], dtype=codec.DTYPES[entry["dtype"]], device=device)
        # gloo cannot broadcast bool tensors; move everything as bytes
        flat = t.view(-1).view(torch.uint8) if t.numel() else t
        if t.numel():
            dist.broadcast(flat, src=src, group=group)
        tensors.append(t.cpu())
    return meta, tensors


def _read_step(
    ckpt: LoadSource,
    *,
    step: int,
    memory: dict[int, shm.Segment],
    on_storage: set[int],
    shard_rank: int,
    replica_group: Any,
    into: Mapping[str, torch.Tensor] | None,
) -> tuple[tuple[dict[str, Any], list[torch.Tensor]] | None, str]:
    """Reads ``step`` from memory or storage; returns (None, source) after warning when it is corrupt."""

    def local() -> tuple[tuple[dict[str, Any], list[torch.Tensor]] | None, str]:
        if step in memory:
            try:
                return read_memory(memory[step], step, into=into, threads=ckpt.copy_threads), "memory"
            except CheckpointCorruptError as exc:
                _warn(f"skipping the in-memory snapshot of step {step}: {exc}")
        if ckpt.storage is not None and step in on_storage:  # the same step, persisted
            try:
                shard = stored_shard(ckpt.storage, step, shard_rank)
                return read_storage(ckpt.storage, step, shard, threads=ckpt.copy_threads), "storage"
            except CheckpointCorruptError as exc:
                _warn(f"skipping the persisted checkpoint step {step}: {exc}")
        return None, "memory" if step in memory else "storage"

    if replica_group is None or not distributed():
        return local()
    if not _all_reduce(int(step not in memory), dist.ReduceOp.MAX, replica_group):
        return local()  # every member holds it in memory
    # One member reads it, from memory rather than storage, and the others receive it: a replacement node
    # gets a data-parallel replica's state from a survivor's memory rather than from storage, or not at all.
    where = 0 if step in memory else 1 if ckpt.storage is not None and step in on_storage else 2
    src = _all_reduce((where << 32) + dist.get_rank(), dist.ReduceOp.MIN, replica_group) & 0xFFFFFFFF
    got, source = local() if dist.get_rank() == src else (None, "peer")
    return _broadcast_shard(got, src=src, group=replica_group), source


def _stored_steps(store: storage.Storage | None, *, memory: Mapping[int, Any]) -> set[int]:
    """The committed steps on storage. Storage that cannot be listed (a bucket gone, an outage), or does
    not answer within :data:`LIST_LIMIT_S` (a hung mount, a stalled bucket), is done without when the
    node's memory holds snapshots, with a warning: a restart in place must not wait for storage. Without
    them it is an error: a job must not silently start from scratch because its checkpoints were out of
    reach for a moment."""
    if store is None:
        return set()
    if not memory:
        try:
            return set(storage.committed_steps(store))
        except OSError as exc:
            raise CheckpointError(
                f"cannot list the checkpoints on {store.url('')}: {exc}; not starting from scratch"
            ) from exc
    listed: dict[str, Any] = {}

    def list_steps() -> None:
        try:
            listed["steps"] = set(storage.committed_steps(store))
        except OSError as exc:
            listed["error"] = exc

    lister = threading.Thread(target=list_steps, name="phalanx-ckpt-list", daemon=True)
    lister.start()
    lister.join(LIST_LIMIT_S)
    if "steps" in listed:
        return set(listed["steps"])
    why = listed.get("error", f"no answer in {LIST_LIMIT_S:g}s")
    _warn(f"cannot list the checkpoints on {store.url('')} ({why}); loading from memory only")
    return set()


def _any_replica(ckpt: LoadSource, own: dict[int, shm.Segment]) -> dict[int, shm.Segment]:
    """The steps this node holds under any rank, this rank's own snapshot first: data-parallel replicas
    all save the same state, and a rank renumbered by a new round finds its old one under another rank."""
    steps = dict(own)
    for rank in sorted(shm.list_job_slots(ckpt.shm_dir, ckpt.job_id)):
        for step, seg in _memory_steps(ckpt.memory_slots(rank)).items():
            steps.setdefault(step, seg)
    return steps


def _lineage(ckpt: LoadSource, step: int) -> dict[str, Any] | None:
    """``{"job", "step"}`` when another job committed ``step``: this job continues that one, and may then
    take its storage over (see storage.claim_decision)."""
    assert ckpt.storage is not None
    saved = storage.commit_record(ckpt.storage, step).get("save")
    job = saved.get("job") if isinstance(saved, dict) else None
    if isinstance(job, str) and job and job != ckpt.job_name:
        log.info("job %s resumes from step %d of job %s", ckpt.job_name, step, job)
        return {"job": job, "step": step}
    return None


def load(
    ckpt: LoadSource,
    *,
    shard_rank: int,
    replica_group: Any = None,
    into: Any = None,
    replicated: bool = False,
) -> LoadReport:
    """See :meth:`phalanx.checkpoint.engine.Checkpointer.load`."""
    started = time.perf_counter()
    targets = None
    if into is not None:
        flat = codec.flatten(into)
        targets = {entry["name"]: t for entry, t in zip(flat.table, flat.tensors, strict=True)}
    reads_before = ckpt.storage.reads if ckpt.storage else 0
    memory = _memory_steps(ckpt.memory_slots(shard_rank))
    if replicated:
        memory = _any_replica(ckpt, memory)
    # Storage is listed once every rank got here: a node whose workers restart in place while a newcomer
    # joins starts them only after its save at breakpoint is on storage, and the newcomer must see it.
    _all_reduce(0, dist.ReduceOp.MAX if distributed() else None)
    on_storage = _stored_steps(ckpt.storage, memory=memory)
    candidates = set(memory) | on_storage
    bad: list[int] = []
    while True:
        step = agree(candidates - set(bad), held_by_any=replicated)
        if step is None:
            if bad:
                raise CheckpointCorruptError(
                    f"every checkpoint candidate failed its check (steps {sorted(bad)}); nothing to load"
                )
            return LoadReport(loaded=None)
        got, source = _read_step(
            ckpt,
            step=step,
            memory=memory,
            on_storage=on_storage,
            shard_rank=shard_rank,
            # replicated: every rank is a replica of every other
            replica_group=dist.group.WORLD if replicated and replica_group is None else replica_group,
            into=targets,
        )
        state: Any = None
        if got is not None:  # rebuilt before the vote: a skeleton that does not decode fails every rank
            try:
                meta, tensors = got
                if targets is not None:  # whichever way it was read: ``into`` ends up holding the state
                    tensors = _fill(targets, meta["tensors"], tensors)
                state = codec.unflatten(meta["skeleton"], tensors)
            except MALFORMED as exc:
                _warn(f"skipping checkpoint step {step}: its structure is malformed ({exc})")
                got = None
        if (
            _all_reduce(int(got is not None), dist.ReduceOp.MIN if distributed() else None)
            and got is not None
        ):
            return LoadReport(
                loaded=(step, state),
                source=source,
                storage_reads=(ckpt.storage.reads if ckpt.storage else 0) - reads_before,
                seconds=time.perf_counter() - started,
                resumed_from=_lineage(ckpt, step) if source != "memory" and step in on_storage else None,
            )
        bad.append(step)
