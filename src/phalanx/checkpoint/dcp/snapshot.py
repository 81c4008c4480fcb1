"""What a rank keeps: its snapshot of a step, built from its local save plan's items. Each tensor chunk
keeps its data with what DCP's metadata needs of it; each other value is kept as plain data (JSON), decoded
from the bytes this process's planner made, never as a pickle. Used by the writer only."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from phalanx.api.errors import CheckpointError
from phalanx.checkpoint import codec

FORMAT = "phalanx-dcp/1"
"""Marks a snapshot written by :class:`~phalanx.checkpoint.dcp.FlashWriter`; a load refuses any other."""


def _dtype_name(dtype: torch.dtype, fqn: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in codec.DTYPES:
        raise TypeError(f"{fqn}: tensors of dtype {dtype} cannot be checkpointed")
    return name


def _tensor_entry(item: WriteItem, data: torch.Tensor) -> dict[str, Any]:
    """One chunk of a tensor as the snapshot keeps it: its data and what DCP's metadata needs of it."""
    fqn, described = item.index.fqn, item.tensor_data
    if described is None:
        raise ValueError(f"{fqn}: a tensor write item without tensor data")
    props = described.properties
    if props.layout != torch.strided or data.layout != torch.strided:
        raise TypeError(f"{fqn}: only dense (strided) tensors can be checkpointed, not {data.layout}")
    if data.dtype != props.dtype or list(data.shape) != list(described.chunk.sizes):
        raise ValueError(
            f"{fqn}: the planner resolved a {data.dtype} tensor of shape {list(data.shape)} for a "
            f"{props.dtype} chunk of shape {list(described.chunk.sizes)}"
        )
    return {
        "fqn": fqn,
        "offsets": list(described.chunk.offsets),
        "sizes": list(described.chunk.sizes),
        "size": list(described.size),
        "dtype": _dtype_name(props.dtype, fqn),
        "requires_grad": bool(props.requires_grad),
        # torch 2.9's properties have no strides (metadata.py)
        "strides": None if (strides := getattr(props, "strides", None)) is None else list(strides),
        "data": data.detach(),
    }


def _value_entry(fqn: str, data: io.BytesIO) -> dict[str, Any]:
    """A non-tensor value, decoded from the bytes this process's planner torch.saved a moment before: the
    snapshot keeps it as plain data (JSON), never as a pickle."""
    data.seek(0)
    try:
        value = torch.load(data, weights_only=True)
    except Exception as exc:  # the restricted unpickler refuses anything but plain data
        raise TypeError(
            f"{fqn}: only plain values (numbers, strings, bytes, lists, tuples, dicts, tensors) can be "
            f"checkpointed without pickle: {exc}"
        ) from exc
    return {"fqn": fqn, "value": value}


def entries(
    items: Iterable[WriteItem], resolve: Callable[[WriteItem], Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The tensor chunks and the other values of ``items``, resolved to their data."""
    tensors, values = [], []
    for item in items:
        data = resolve(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{item.index.fqn}: the planner resolved {type(data).__name__}, not bytes")
            values.append(_value_entry(item.index.fqn, data))
        elif isinstance(data, torch.Tensor):
            tensors.append(_tensor_entry(item, data))
        else:
            raise TypeError(f"{item.index.fqn}: the planner resolved {type(data).__name__}, not a tensor")
    return tensors, values


def kept_indices(tensors: list[dict[str, Any]], values: list[dict[str, Any]]) -> set[MetadataIndex]:
    return {MetadataIndex(e["fqn"], e["offsets"]) for e in tensors} | {
        MetadataIndex(e["fqn"]) for e in values
    }


def check_plan_kept(plan: SavePlan, kept: set[MetadataIndex]) -> None:
    """Every item DCP asks this rank to write must be in the snapshot (a custom planner may differ)."""
    missing = [item.index for item in plan.items if item.index not in kept]
    if missing:
        shown = ", ".join(f"{i.fqn}@{list(i.offset) if i.offset is not None else ''}" for i in missing[:5])
        raise CheckpointError(
            f"the save plan asks for {len(missing)} items the snapshot does not hold ({shown}): FlashWriter "
            "keeps what DefaultSavePlanner plans, and a planner that plans otherwise is not supported"
        )
