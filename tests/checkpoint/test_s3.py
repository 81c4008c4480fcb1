"""Checkpoint storage in an S3 bucket (``s3://bucket/prefix``), against a real MinIO server (the ``minio``
fixture of tests/conftest.py): the storage contract, multipart uploads that appear whole or not at
all, the commit protocol and retention, and the flash checkpoint persisting to and loading from the bucket,
including a corrupt object and a bucket that does not exist."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

from phalanx.api.errors import CheckpointError, PersistError
from phalanx.checkpoint import Checkpointer, CheckpointWarning, storage
from phalanx.checkpoint import host as host_mod
from tests.checkpoint.test_roundtrip import assert_same, training_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # a cold build of MinIO is slow


@pytest.fixture
def bucket(minio: str) -> str:
    """A fresh bucket; its name."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    storage.S3Storage(name).client.create_bucket(Bucket=name)
    return name


def test_the_storage_contract_holds_in_a_bucket(bucket: str) -> None:
    store = storage.open_storage(f"s3://{bucket}/jobs/gpt")
    assert isinstance(store, storage.S3Storage)
    assert store.write_atomic("step-000000000001/rank-00000.json", [b'{"a":', memoryview(b" 1}")]) == 8
    store.write_atomic("step-000000000001/rank-00001.json", [b"{}"])
    store.write_atomic("step-000000000002/rank-00000.json", [b"{}"])
    assert store.read("step-000000000001/rank-00000.json") == b'{"a": 1}'
    assert store.reads == 1
    assert store.exists("step-000000000001/rank-00001.json")
    assert not store.exists("step-000000000001/rank-00002.json")
    assert store.list("") == ["step-000000000001", "step-000000000002"]
    assert store.list("step-000000000001") == ["rank-00000.json", "rank-00001.json"]
    assert store.list("step-000000000009") == []
    with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/jobs/gpt/step-000000000009/x"):
        store.read("step-000000000009/x")
    store.remove_dir("step-000000000001")
    assert store.list("") == ["step-000000000002"]
    assert store.url("a/b") == f"s3://{bucket}/jobs/gpt/a/b"


def test_a_large_file_goes_in_parts_and_a_failed_upload_leaves_nothing(bucket: str) -> None:
    store = storage.S3Storage(bucket, "big")
    store.PART_BYTES = 5 << 20  # S3's smallest part: 12 MiB go in three
    blob = os.urandom(12 << 20)
    chunks = [memoryview(blob)[i : i + (1 << 20)] for i in range(0, len(blob), 1 << 20)]
    assert store.write_atomic("shard", chunks) == len(blob)
    assert store.read("shard") == blob
    head = store.client.head_object(Bucket=bucket, Key="big/shard", PartNumber=1)
    assert head.get("PartsCount") == 3, "uploaded in parts"

    def dying() -> Iterator[bytes]:
        yield blob[: 11 << 20]  # two parts are uploaded, then the source fails
        raise OSError("the shared memory went away")

    with pytest.raises(OSError, match="the shared memory went away"):
        store.write_atomic("torn", dying())
    assert not store.exists("torn")
    assert store.client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == [], "aborted, not left"


def test_commit_protocol_and_retention_in_a_bucket(bucket: str) -> None:
    store = storage.open_storage(f"s3://{bucket}/run")
    for step in (1, 2, 3):
        store.write_atomic(storage.manifest_file(step, 0), [b"{}"])
        assert not storage.try_commit(store, step=step, world_size=2), "rank 1's manifest is missing"
        store.write_atomic(storage.manifest_file(step, 1), [b"{}"])
        assert storage.try_commit(store, step=step, world_size=2)
    store.write_atomic(storage.manifest_file(4, 0), [b"{}"])  # a step still being written
    assert storage.committed_steps(store) == [1, 2, 3]
    assert storage.committed_world_size(store, 3) == 2
    assert storage.apply_retention(store, keep_last=2) == [1]
    assert storage.step_dirs(store) == [2, 3, 4]


@pytest.fixture
def s3_host(bucket: str, job_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A checkpoint host persisting to the bucket, advertised in this process's environment."""
    handle = host_mod.start(
        job_id=job_id, storage=f"s3://{bucket}/{job_id}", keep_last=2, socket_path=tmp_path / "host.sock"
    )
    for key, value in handle.env().items():
        monkeypatch.setenv(key, value)
    yield handle
    handle.stop()


def test_a_checkpoint_persisted_to_s3_loads_on_a_new_node(
    s3_host: host_mod.HostHandle, bucket: str, job_id: str, tmp_path: Path
) -> None:
    state = training_state()
    ckpt = Checkpointer()
    for step in (4, 5):
        ckpt.save(step, state if step == 5 else training_state(1), persist=True)
        assert ckpt.wait()[0]["committed"]
    ckpt.close()
    s3_host.stop()  # the node goes away with its memory
    location = f"s3://{bucket}/{job_id}"
    store = storage.open_storage(location)
    assert storage.committed_steps(store) == [4, 5]
    raw = store.read(storage.shard_file(5, 0))
    assert torch.equal(load_safetensors(raw)["model/0.weight"], state["model"]["0.weight"]), (
        "plain safetensors"
    )
    fresh = Checkpointer(storage=location, shm_dir=str(tmp_path))
    step, got = fresh.load()  # type: ignore[misc]
    assert step == 5
    assert fresh.last_load["source"] == "storage"
    assert_same(state, got)

    # A corrupt object is detected, named, and the previous committed step is loaded instead.
    data = bytearray(raw)
    data[-10] ^= 0xFF
    store.write_atomic(storage.shard_file(5, 0), [bytes(data)])
    with pytest.warns(CheckpointWarning, match=f"s3://{bucket}/{job_id}/step-000000000005/rank-00000"):
        step, got = Checkpointer(storage=location, shm_dir=str(tmp_path)).load()  # type: ignore[misc]
    assert step == 4
    assert_same(training_state(1), got)


def test_a_bucket_that_does_not_exist_is_a_clear_error_and_the_memory_snapshot_survives(
    minio: str, job_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = host_mod.start(
        job_id=job_id, storage="s3://no-such-bucket/x", keep_last=2, socket_path=tmp_path / "host.sock"
    )
    try:
        for key, value in handle.env().items():
            monkeypatch.setenv(key, value)
        ckpt = Checkpointer()
        state = {"w": torch.arange(1000, dtype=torch.float32)}
        ckpt.save(3, state, persist=True)
        with pytest.raises(PersistError, match=r"s3://no-such-bucket/x/.*NoSuchBucket"):
            ckpt.wait()
        with pytest.warns(CheckpointWarning, match="s3://no-such-bucket/x.*loading from memory only"):
            step, got = ckpt.load()  # type: ignore[misc]
        assert step == 3, "the memory snapshot is intact"
        assert ckpt.last_load["source"] == "memory"
        assert torch.equal(got["w"], state["w"])
        ckpt.close()
    finally:
        handle.stop()
    # A node without the memory must not take unreachable storage for "no checkpoint" and start afresh.
    fresh = Checkpointer(storage="s3://no-such-bucket/x", shm_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match="cannot list the checkpoints on s3://no-such-bucket/x"):
        fresh.load()


def test_of_jobs_claiming_one_bucket_prefix_at_once_exactly_one_gets_it(bucket: str) -> None:
    from tests.checkpoint.test_local_trust import race_for_the_claim

    for attempt in range(3):
        race_for_the_claim(storage.open_storage(f"s3://{bucket}/race-{attempt}"))
