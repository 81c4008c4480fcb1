"""Pure pieces: the skeleton codec, the commit protocol and retention on a plain directory."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from phalanx.api.errors import CheckpointError
from phalanx.checkpoint import codec, copier, shm, storage
from tests.eventually import eventually


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


def test_a_retention_cut_short_leaves_no_committed_step_without_its_shards(tmp_path: Path) -> None:
    """The removal of an old step fails halfway (its directory cannot be deleted): the step is no longer
    committed, so no restore takes it for whole; the next retention removes what is left."""

    class FailingRemoval(storage.LocalStorage):
        def remove_dir(self, path: str) -> None:
            raise OSError(f"{path}: the disk went away")

    store = FailingRemoval(tmp_path)
    for step in (1, 2, 3):
        for rank in (0, 1):
            write_shard(store, step, rank)
        assert storage.try_commit(store, step=step, world_size=2)
    with pytest.raises(OSError, match="went away"):
        storage.apply_retention(store, keep_last=2)
    assert storage.committed_steps(store) == [2, 3]
    assert storage.step_dirs(store) == [1, 2, 3], "step 1's shards are still there, uncommitted"
    assert storage.apply_retention(storage.LocalStorage(tmp_path), keep_last=2) == [1]
    assert storage.step_dirs(store) == [2, 3]


def test_background_copy_is_bitwise_and_completes_once_whoever_copies_the_last_chunk() -> None:
    big = torch.randn(3 * copier.CHUNK // 4 + 5)  # several chunks, the last one short
    strided = torch.arange(40.0).view(5, 8).t()  # not contiguous: copied by torch, not memmove
    sources = [big, strided, torch.zeros(0), torch.tensor(7, dtype=torch.int64)]
    for fence_at_once in (True, False):
        dests = [torch.empty_like(t) for t in sources]
        done: list[bool] = []
        job = copier.BackgroundCopy(
            list(zip(dests, sources, strict=True)), threads=2, on_done=lambda: done.append(True)
        )
        if not fence_at_once:  # idle cores here: the background finishes it alone
            eventually(job.done, timeout=30, what="the background copy finishing alone", interval=0.01)
            assert done == [True]
        job.wait()
        assert done == [True]
        assert all(torch.equal(d, t) for d, t in zip(dests, sources, strict=True))
    assert job.copy_s > 0


def test_background_copy_failure_is_raised_at_the_fence_and_never_marked_complete() -> None:
    def broken() -> None:
        raise OSError("header write failed")

    job = copier.BackgroundCopy([(torch.empty(10), torch.ones(10))], threads=1, on_done=broken)
    with pytest.raises(CheckpointError, match="header write failed"):
        job.wait()
    assert job.done()


def test_canonical_location_makes_two_spellings_of_one_place_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    same = {
        storage.canonical_location(x)
        for x in ("ckpt", "./ckpt/", f"file://{tmp_path}/ckpt", str(tmp_path / "ckpt"))
    }
    assert same == {str(tmp_path / "ckpt")}
    assert storage.canonical_location("s3://bucket/run-1/") == "s3://bucket/run-1"
    assert storage.canonical_location("s3://bucket/run-1") != storage.canonical_location("s3://bucket/run-2")
    assert storage.canonical_location("") == ""
