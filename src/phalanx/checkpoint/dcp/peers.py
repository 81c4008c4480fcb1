"""Chunks and values a rank cannot read on its node, received from a rank that holds them in its memory: a
replacement node's ranks load a replica (HSDP's other replica group, a data-parallel copy) from the survivors'
memory, where they would otherwise wait for storage, or start over when the step was never persisted.

DCP's coordinator plans every transfer once (:func:`plan_transfers`, a pure function) and DCP scatters the
plan: each rank is given the transfers it takes part in, numbered in one global order, and runs them in that
order with point-to-point sends (:func:`exchange`). A rank waits only for its partner in the transfer at hand,
and every pair meets its transfers in the same order, so no order of ranks deadlocks. What travels is what a
snapshot holds, split by the codec (a JSON skeleton, then each tensor's bytes): never a pickle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx.api.errors import CheckpointCorruptError
from phalanx.checkpoint import codec
from phalanx.checkpoint.dcp.metadata import Snapshot
from phalanx.checkpoint.restore import collective_device
from phalanx.checkpoint.structure import MALFORMED

Key = tuple[str, tuple[int, ...] | None]
"""A chunk (its fqn and offsets) or a value (its fqn and None), as a snapshot holds it."""

Transfer = tuple[int, int, int, Key]
"""(number, source rank, destination rank, key): the number orders the transfers and tags their messages."""


def plan_transfers(
    needs: Mapping[int, Sequence[Key]], holders: Mapping[Key, Sequence[int]]
) -> list[Transfer]:
    """The transfers that give each rank the keys it ``needs`` (rank -> keys), each from one of the ranks
    ``holders`` lists for it (ranks holding it in their own snapshot in memory; never the rank itself): the
    holder that has been given the fewest keys to send so far, the lowest rank among equals, so that a load
    spreads over the replicas. A key no other rank holds is left out: the reader then names it when it reads.
    Deterministic: every rank would plan the same."""
    sent: dict[int, int] = {}
    transfers: list[Transfer] = []
    for dst in sorted(needs):
        for key in dict.fromkeys(needs[dst]):  # each key once, in the order asked
            candidates = [rank for rank in holders.get(key, ()) if rank != dst]
            if not candidates:
                continue
            src = min(candidates, key=lambda rank: (sent.get(rank, 0), rank))
            sent[src] = sent.get(src, 0) + 1
            transfers.append((len(transfers), src, dst, key))
    return transfers


def involving(transfers: Sequence[Transfer], rank: int) -> list[Transfer]:
    """The transfers ``rank`` sends or receives, in the global order."""
    return [t for t in transfers if rank in (t[1], t[2])]


def exchange(transfers: Sequence[Transfer], *, me: int, own: Snapshot | None) -> Snapshot:
    """Runs this rank's ``transfers`` in order: sends what its ``own`` snapshot holds, receives the rest; what
    it received, as a snapshot (of rank -1: several ranks' parts)."""
    chunks: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    values: dict[str, Any] = {}
    for number, src, dst, (fqn, offsets) in transfers:
        if src == me:
            if own is None:
                raise CheckpointCorruptError(f"{fqn}: asked to send from a snapshot this rank does not hold")
            _send(own.chunks[(fqn, offsets)] if offsets is not None else own.values[fqn], dst, number)
        elif dst == me:
            got = _receive(src, number, fqn)
            if offsets is None:
                values[fqn] = got
            elif isinstance(got, torch.Tensor):
                chunks[(fqn, offsets)] = got
            else:
                raise CheckpointCorruptError(f"{fqn}: rank {src} sent a value where a chunk was asked for")
    return Snapshot(rank=-1, chunks=chunks, values=values)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    # gloo sends no bool tensors, and a 0-d tensor has no flat view: everything travels as bytes
    return tensor.contiguous().view(-1).view(torch.uint8)


def _send(item: Any, dst: int, tag: int) -> None:
    device = collective_device()
    flat = codec.flatten(item)
    header = json.dumps(
        {"skeleton": flat.skeleton, "table": [[e["dtype"], e["shape"]] for e in flat.table]}
    ).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=device), dst, tag=tag)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), dst, tag=tag)
    for tensor in flat.tensors:
        if tensor.numel():
            dist.send(_bytes_of(tensor).to(device), dst, tag=tag)


def _receive(src: int, tag: int, fqn: str) -> Any:
    device = collective_device()
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src, tag=tag)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(raw, src, tag=tag)
    try:
        header = json.loads(raw.cpu().numpy().tobytes())
        tensors = [
            torch.empty(shape, dtype=codec.DTYPES[dtype], device=device) for dtype, shape in header["table"]
        ]
    except (ValueError, *MALFORMED) as exc:
        raise CheckpointCorruptError(f"{fqn}: rank {src} sent a malformed part: {exc}") from exc
    for tensor in tensors:
        if tensor.numel():
            dist.recv(_bytes_of(tensor), src, tag=tag)
    try:
        return codec.unflatten(header["skeleton"], [t.cpu() for t in tensors])
    except (ValueError, *MALFORMED) as exc:
        raise CheckpointCorruptError(f"{fqn}: rank {src} sent a malformed part: {exc}") from exc
