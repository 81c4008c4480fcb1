"""Structure checks of a snapshot's metadata and of a persisted shard's manifest: what a load finds wrong
here counts as corrupt, on every rank alike, before the ranks vote on a step."""

from __future__ import annotations

from typing import Any

from phalanx.checkpoint import codec

MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError)
"""What reading a shard of the wrong structure raises (torch raises RuntimeError for a bad view)."""


def meta_problem(meta: Any) -> str:
    """What is wrong with the structure of a snapshot's metadata ("" when nothing): the tensor table must
    describe tensors safetensors and torch can hold, laid out as the byte counts say."""
    if not isinstance(meta, dict):
        return "the metadata is not a JSON object"
    if "skeleton" not in meta:
        return "the metadata has no skeleton"
    table = meta.get("tensors")
    if not isinstance(table, list):
        return "the metadata has no tensor table"
    for i, entry in enumerate(table):
        if not isinstance(entry, dict):
            return f"tensor {i} is not described by an object"
        name, dtype, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
        offset, nbytes = entry.get("offset"), entry.get("nbytes")
        if not isinstance(name, str) or dtype not in codec.DTYPES:
            return f"tensor {i} has no name or an unknown dtype ({dtype!r})"
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            return f"tensor {name!r} has a malformed shape {shape!r}"
        if type(offset) is not int or type(nbytes) is not int or offset < 0:
            return f"tensor {name!r} has a malformed offset or size"
        count = 1
        for d in shape:
            count *= d
        if nbytes != count * codec.DTYPES[dtype].itemsize:
            return f"tensor {name!r}: {nbytes} bytes do not hold a {dtype} tensor of shape {shape}"
    return ""


def manifest_problem(manifest: Any) -> str:
    """What is wrong with the structure of a shard manifest ("" when nothing)."""
    if not isinstance(manifest, dict):
        return "the manifest is not a JSON object"
    for key in ("size", "crc32"):
        if type(manifest.get(key)) is not int:
            return f"the manifest's {key!r} is missing or not an integer"
    return meta_problem(manifest.get("meta"))
