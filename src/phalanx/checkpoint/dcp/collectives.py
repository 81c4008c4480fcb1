"""Collectives of bytes: the ranks' descriptions of their snapshots travel as JSON in uint8 tensors, never
pickled."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from phalanx.api.errors import CheckpointCorruptError
from phalanx.checkpoint import codec
from phalanx.checkpoint.dcp.metadata import describe
from phalanx.checkpoint.restore import collective_device, distributed
from phalanx.checkpoint.structure import MALFORMED


def all_gather_bytes(blob: bytes) -> list[bytes]:
    """Every rank's ``blob``, in rank order."""
    if not distributed():
        return [blob]
    device = collective_device()
    length = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    counts = [int(n.item()) for n in lengths]
    mine = torch.zeros(max(1, *counts), dtype=torch.uint8)
    if blob:
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in counts]
    dist.all_gather(gathered, mine)
    return [t[:n].cpu().numpy().tobytes() for t, n in zip(gathered, counts, strict=True)]


def encode_description(state: dict[str, Any]) -> Any:
    flat = codec.flatten(describe(state))
    assert not flat.tensors, "a description holds no tensors"
    return flat.skeleton


def decode_descriptions(blobs: list[bytes], step: int) -> list[dict[str, Any]]:
    """Every rank's description of its snapshot of ``step``; CheckpointCorruptError naming the ranks whose
    snapshot is unusable."""
    try:
        sent = [json.loads(blob) for blob in blobs]
        problems = [f"rank {rank}: {s['problem']}" for rank, s in enumerate(sent) if s["problem"]]
        descriptions = [] if problems else [codec.unflatten(s["description"], []) for s in sent]
    except (ValueError, *MALFORMED) as exc:
        raise CheckpointCorruptError(
            f"step {step}: a rank's snapshot description is malformed: {exc}"
        ) from exc
    if problems:
        raise CheckpointCorruptError(f"step {step} cannot be loaded: {'; '.join(problems)}")
    return descriptions
