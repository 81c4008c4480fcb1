"""Splits a training state into a JSON skeleton and a list of tensors, and puts it back together.

The skeleton keeps every container and plain value with its exact type (dict keys of any plain type,
lists, tuples, ints, floats, bools, None, str, bytes, numpy arrays and scalars as JSON lists), and
refers to tensors by index. Nothing is pickled, so a snapshot is safe to load from anywhere.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from phalanx.checkpoint.shm import TENSOR_ALIGN, align
from phalanx.checkpoint.storage import SAFETENSORS_DTYPES

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in SAFETENSORS_DTYPES
    if isinstance(getattr(torch, name, None), torch.dtype)
}


@dataclass(frozen=True)
class Flat:
    """A state split into a skeleton and its tensors, with the shared-memory layout of the tensors."""

    skeleton: Any
    tensors: list[torch.Tensor]
    table: list[dict[str, Any]]  # name, dtype, shape, offset (from the data start), nbytes
    data_len: int


def _dtype_name(t: torch.Tensor, path: str) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"{path}: tensors of dtype {t.dtype} cannot be checkpointed")
    return name


def flatten(state: Any) -> Flat:
    """Splits ``state``; raises TypeError naming the path of anything it cannot represent."""
    tensors: list[torch.Tensor] = []
    table: list[dict[str, Any]] = []
    names: set[str] = set()
    offset = 0

    def enc(value: Any, path: str) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            t = value.detach()
            name = path or "tensor"
            if name in names:
                name = f"{name}#{len(tensors)}"
            names.add(name)
            nbytes = t.numel() * t.element_size()
            table.append(
                {
                    "name": name,
                    "dtype": _dtype_name(t, path),
                    "shape": list(t.shape),
                    "offset": offset,
                    "nbytes": nbytes,
                }
            )
            offset = align(offset + nbytes, TENSOR_ALIGN)
            tensors.append(t)
            return {"T": len(tensors) - 1}
        if value is None or isinstance(value, bool | int | float | str):
            return {"v": value}
        if isinstance(value, dict):
            kind = "O" if isinstance(value, OrderedDict) else "D"  # state_dict() returns OrderedDicts
            items = [
                [enc(k, f"{path}/k"), enc(v, f"{path}/{k}" if path else str(k))] for k, v in value.items()
            ]
            return {kind: items}
        if isinstance(value, list):
            return {"L": [enc(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, tuple):
            return {"U": [enc(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, np.ndarray):
            return {"A": [str(value.dtype), list(value.shape), value.ravel().tolist()]}
        if isinstance(value, np.generic):
            return {"n": [str(value.dtype), value.item()]}
        if isinstance(value, bytes):
            return {"B": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            return {"t": str(value).removeprefix("torch.")}
        raise TypeError(f"{path or 'state'}: cannot checkpoint a value of type {type(value).__name__}")

    skeleton = enc(state, "")
    return Flat(skeleton=skeleton, tensors=tensors, table=table, data_len=offset)


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuilds the state from its skeleton and tensors (in table order)."""

    def dec(node: Any) -> Any:
        ((kind, body),) = node.items()
        if kind == "T":
            return tensors[body]
        if kind == "v":
            return body
        if kind == "D":
            return {dec(k): dec(v) for k, v in body}
        if kind == "O":
            return OrderedDict((dec(k), dec(v)) for k, v in body)
        if kind == "L":
            return [dec(v) for v in body]
        if kind == "U":
            return tuple(dec(v) for v in body)
        if kind == "A":
            dtype, shape, data = body
            return np.array(data, dtype=dtype).reshape(shape)
        if kind == "n":
            return np.dtype(body[0]).type(body[1])
        if kind == "B":
            return base64.b64decode(body)
        if kind == "t":
            return getattr(torch, body)
        raise ValueError(f"unknown skeleton node {kind!r}")

    return dec(skeleton)
