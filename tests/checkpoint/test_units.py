"""Pure pieces: the skeleton codec, the commit protocol and retention on a plain directory."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from phalanx.checkpoint import codec, copier, shm, storage


def test_codec_keeps_types_and_refuses_what_it_cannot_represent() -> None:
    state = OrderedDict(
        a={1: (2, 3.5), "x": [None, True, b"\x01"]},
        t=torch.arange(4),
        n=np.arange(3, dtype=np.uint32),
        s=np.float64(1.5),
        d=torch.float16,
    )
    flat = codec.flatten(state)
    json.dumps(flat.skeleton)  # the skeleton is plain JSON
    back = codec.unflatten(json.loads(json.dumps(flat.skeleton)), flat.tensors)
    assert type(back) is OrderedDict
    assert back["a"] == {1: (2, 3.5), "x": [None, True, b"\x01"]}
    assert back["n"].dtype == np.uint32
    assert back["s"] == np.float64(1.5)
    assert back["d"] is torch.float16
    assert all(e["offset"] % shm.TENSOR_ALIGN == 0 for e in flat.table)
    with pytest.raises(TypeError, match="a/b"):
        codec.flatten({"a": {"b": object()}})
    with pytest.raises(TypeError, match="complex"):
        codec.flatten({"c": torch.zeros(2, dtype=torch.complex64)})


def test_header_round_trip_and_field_setters() -> None:
    buf = bytearray(shm.HEADER_SIZE)
    assert not shm.read_header(bytes(buf)).complete  # never written: empty
    header = shm.SlotHeader(
        state=shm.STATE_COMPLETE, seq=9, step=42, meta_len=10, data_off=4096, rank=3, world_size=8
    )
    shm.pack_header(memoryview(buf), header)
    shm.set_crc(buf, crc=1234, seq=9)  # type: ignore[arg-type]
    shm.set_pin(buf, 1)  # type: ignore[arg-type]
    got = shm.read_header(bytes(buf))
    assert got.step == 42
    assert (got.crc, got.crc_seq, got.pin, got.rank, got.world_size) == (1234, 9, 1, 3, 8)


def write_shard(store: storage.LocalStorage, step: int, rank: int) -> None:
    store.write_atomic(storage.manifest_file(step, rank), [b"{}"])


def test_commit_only_when_every_rank_is_present_and_retention(tmp_path: Path) -> None:
    store = storage.LocalStorage(tmp_path)
    write_shard(store, 1, 0)
    assert not storage.try_commit(store, step=1, world_size=2)
    write_shard(store, 1, 1)
    assert storage.try_commit(store, step=1, world_size=2)
    for step in (2, 3):
        for rank in (0, 1):
            write_shard(store, step, rank)
        storage.try_commit(store, step=step, world_size=2)
    write_shard(store, 4, 0)  # in progress on another node: never removed by retention
    assert storage.apply_retention(store, keep_last=2) == [1]
    assert storage.committed_steps(store) == [2, 3]
    assert storage.step_dirs(store) == [2, 3, 4]
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary files remain


@pytest.mark.parametrize(
    ("sizes", "parts"), [([10, 0, 7, 30], 3), ([5], 4), ([0, 0], 2), ([1 << 20, 3, 4096], 1), ([8, 8], 2)]
)
def test_split_covers_every_byte_once_in_nearly_equal_runs(sizes: list[int], parts: int) -> None:
    runs = copier.split(sizes, parts)
    covered: dict[int, list[tuple[int, int]]] = {}
    for run in runs:
        assert run, "no empty runs"
        for index, offset, length in run:
            assert length > 0
            covered.setdefault(index, []).append((offset, length))
    for index, size in enumerate(sizes):
        spans = sorted(covered.get(index, []))
        at = 0
        for offset, length in spans:
            assert offset == at, (index, spans)
            at += length
        assert at == size
    totals = [sum(length for _, _, length in run) for run in runs]
    assert len(runs) <= parts
    if totals:
        assert max(totals) - min(totals) <= -(-sum(sizes) // len(runs))
        assert max(totals) <= -(-sum(sizes) // parts)
