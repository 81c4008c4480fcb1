"""Reading snapshots back: their structure, their descriptions (a snapshot less its data), and DCP's global
``Metadata`` built from every rank's description. Pure functions: anything not saved by FlashWriter, or
descriptions that do not make one whole checkpoint of one save, are refused, never guessed at."""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from phalanx.api.errors import CheckpointCorruptError
from phalanx.checkpoint import codec
from phalanx.checkpoint.dcp.snapshot import FORMAT


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One rank's snapshot of a step, as a load reads from it."""

    rank: int
    chunks: dict[tuple[str, tuple[int, ...]], torch.Tensor]  # (fqn, offsets) -> the chunk
    values: dict[str, Any]


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _chunk_problem(entry: Any, *, with_data: bool) -> str:
    """What is wrong with one tensor chunk of a snapshot or description ("" when nothing)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("fqn"), str):
        return "a tensor chunk has no fqn"
    fqn: str = entry["fqn"]
    offsets: Any = entry.get("offsets")
    sizes: Any = entry.get("sizes")
    size: Any = entry.get("size")
    if not (_naturals(offsets) and _naturals(sizes) and _naturals(size)) or not (
        len(offsets) == len(sizes) == len(size)
    ):
        return f"{fqn}: malformed offsets, sizes or size"
    if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
        return f"{fqn}: a chunk at {offsets} of sizes {sizes} lies outside its tensor of size {size}"
    strides = entry.get("strides")
    if (
        entry.get("dtype") not in codec.DTYPES
        or type(entry.get("requires_grad")) is not bool
        or not (strides is None or (isinstance(strides, list) and all(type(v) is int for v in strides)))
    ):
        return f"{fqn}: malformed tensor properties"
    data = entry.get("data")
    if with_data and not (
        isinstance(data, torch.Tensor)
        and list(data.shape) == sizes
        and str(data.dtype).removeprefix("torch.") == entry["dtype"]
    ):
        return f"{fqn}: the chunk at {offsets} does not hold a {entry['dtype']} tensor of shape {sizes}"
    return ""


def snapshot_problem(state: Any, *, with_data: bool) -> str:
    """What is wrong with the structure of a snapshot (``with_data``) or of its description ("" when
    nothing): anything not saved by FlashWriter is refused, never guessed at."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return "it was not saved by phalanx.checkpoint.dcp.FlashWriter"
    for key in ("rank", "world_size", "round"):
        if type(state.get(key)) is not int or state[key] < 0:
            return f"its {key!r} is missing or not a natural number"
    if state["rank"] >= state["world_size"]:
        return f"rank {state['rank']} of a world of {state['world_size']}"
    if not (state.get("planner_data") is None or isinstance(state["planner_data"], dict)):
        return "its planner data is not a mapping"
    tensors, values = state.get("tensors"), state.get("values")
    if not isinstance(tensors, list) or not isinstance(values, list):
        return "it has no table of tensor chunks or of values"
    for entry in tensors:
        problem = _chunk_problem(entry, with_data=with_data)
        if problem:
            return problem
    for entry in values:
        if not isinstance(entry, dict) or not isinstance(entry.get("fqn"), str):
            return "a value has no fqn"
        if with_data and "value" not in entry:
            return f"{entry['fqn']}: the value is missing"
    return ""


def snapshot_of(state: dict[str, Any]) -> Snapshot:
    return Snapshot(
        rank=state["rank"],
        chunks={(e["fqn"], tuple(e["offsets"])): e["data"] for e in state["tensors"]},
        values={e["fqn"]: e["value"] for e in state["values"]},
    )


def describe(state: dict[str, Any]) -> dict[str, Any]:
    """A snapshot without its data: what DCP's metadata needs of it."""
    return {
        **{key: state[key] for key in ("format", "rank", "world_size", "round", "planner_data")},
        "tensors": [{k: v for k, v in entry.items() if k != "data"} for entry in state["tensors"]],
        "values": [{"fqn": entry["fqn"]} for entry in state["values"]],
    }


def description_of_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The description of a snapshot from its JSON metadata alone (a slot's, or a persisted manifest's):
    without reading its tensors."""
    unread: list[Any] = [None] * len(meta["tensors"])  # the skeleton's places of the tensors, left empty
    state = codec.unflatten(meta["skeleton"], unread)
    problem = snapshot_problem(state, with_data=False)
    if problem:
        raise CheckpointCorruptError(problem)
    return describe(state)


# torch 2.9 (the oldest the trainer supports, pyproject.toml) has no strides in a tensor's DCP properties; a
# checkpoint saved with them still loads there: a chunk's layout is its offsets and sizes.
_HAS_STRIDES = "strides" in TensorProperties.__dataclass_fields__


def _properties(dtype: torch.dtype, requires_grad: bool, strides: list[int] | None) -> TensorProperties:
    if not _HAS_STRIDES:
        return TensorProperties(dtype=dtype, requires_grad=requires_grad)
    return TensorProperties(
        dtype=dtype, requires_grad=requires_grad, strides=None if strides is None else tuple(strides)
    )


def _add_chunk(
    metadata: dict[str, STORAGE_TYPES],
    holders: dict[MetadataIndex, list[int]],
    sizes: dict[MetadataIndex, list[int]],
    rank: int,
    entry: dict[str, Any],
) -> None:
    fqn, dtype, size = entry["fqn"], codec.DTYPES[entry["dtype"]], torch.Size(entry["size"])
    known = metadata.get(fqn)
    if known is None:
        properties = _properties(dtype, entry["requires_grad"], entry["strides"])
        known = metadata[fqn] = TensorStorageMetadata(properties=properties, size=size, chunks=[])
    elif not isinstance(known, TensorStorageMetadata):
        raise CheckpointCorruptError(f"{fqn}: one rank saved it as a value and rank {rank} as a tensor")
    elif known.properties.dtype != dtype or known.size != size:
        raise CheckpointCorruptError(
            f"{fqn}: rank {rank} saved a {dtype} tensor of size {list(size)}, another a "
            f"{known.properties.dtype} tensor of size {list(known.size)}"
        )
    index = MetadataIndex(fqn, entry["offsets"])
    if index not in holders:
        known.chunks.append(
            ChunkStorageMetadata(offsets=torch.Size(entry["offsets"]), sizes=torch.Size(entry["sizes"]))
        )
        holders[index], sizes[index] = [], entry["sizes"]
    elif sizes[index] != entry["sizes"]:
        raise CheckpointCorruptError(
            f"{fqn}: the chunks at {entry['offsets']} of two ranks differ in size "
            f"({sizes[index]} and {entry['sizes']})"
        )
    holders[index].append(rank)


def _coverage_problem(fqn: str, tensor: TensorStorageMetadata) -> str:
    """A tensor whose chunks do not add up to it lacks a chunk (DCP's load would leave that part of the
    destination as it was). Chunks never overlap: DCP's planner refuses overlapping ones at save."""
    whole = math.prod(tensor.size)
    held = sum(math.prod(chunk.sizes) for chunk in tensor.chunks)
    if held != whole:
        return f"{fqn}: its chunks hold {held} of its {whole} elements"
    return ""


def build_metadata(descriptions: list[dict[str, Any]], *, partial: bool = False) -> Metadata:
    """DCP's global ``Metadata`` of one step from the descriptions of every saving rank's snapshot, as DCP's
    default planner builds it at save (less its deduplication). ``storage_data`` maps the
    :class:`MetadataIndex` of every chunk and value to the ranks whose snapshots hold it, lowest first.
    Descriptions of one rank given twice count once. Raises CheckpointCorruptError when the descriptions
    do not make one whole checkpoint of one save. ``partial``: some saving ranks' snapshots are lost (with
    their node), and the others' must hold every tensor whole (replicas: HSDP, data parallel)."""
    if not descriptions:
        raise CheckpointCorruptError("no snapshot to describe the checkpoint")
    for description in descriptions:
        problem = snapshot_problem(description, with_data=False)
        if problem:
            raise CheckpointCorruptError(f"a snapshot's description is malformed: {problem}")
    saves = sorted({(d["world_size"], d["round"]) for d in descriptions})
    if len(saves) > 1:
        raise CheckpointCorruptError(f"the snapshots come from different saves (world size, round): {saves}")
    by_rank: dict[int, dict[str, Any]] = {}
    for description in sorted(descriptions, key=lambda d: int(d["rank"])):
        by_rank.setdefault(description["rank"], description)
    missing = sorted(set(range(saves[0][0])) - set(by_rank))
    if missing and not partial:
        raise CheckpointCorruptError(f"the snapshots of ranks {missing} are missing")
    metadata: dict[str, STORAGE_TYPES] = {}
    holders: dict[MetadataIndex, list[int]] = {}
    sizes: dict[MetadataIndex, list[int]] = {}
    planner_data: dict[Any, Any] | None = None
    for rank, description in by_rank.items():
        for entry in description["tensors"]:
            _add_chunk(metadata, holders, sizes, rank, entry)
        for entry in description["values"]:
            fqn = entry["fqn"]
            if not isinstance(metadata.setdefault(fqn, BytesStorageMetadata()), BytesStorageMetadata):
                raise CheckpointCorruptError(
                    f"{fqn}: one rank saved it as a tensor and rank {rank} as a value"
                )
            holders.setdefault(MetadataIndex(fqn), []).append(rank)
        if description["planner_data"] is not None:
            planner_data = planner_data if planner_data is not None else {}
            for key, path in description["planner_data"].items():
                planner_data.setdefault(key, path)  # as DCP merges the ranks' mappings: the first one wins
    for fqn, stored in metadata.items():
        problem = _coverage_problem(fqn, stored) if isinstance(stored, TensorStorageMetadata) else ""
        if problem:
            raise CheckpointCorruptError(problem)
    return Metadata(
        state_dict_metadata=metadata,
        planner_data=planner_data,
        storage_data=holders,
        storage_meta=StorageMeta(load_id=str(uuid.uuid4())),
    )
