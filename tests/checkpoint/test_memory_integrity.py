"""In-memory snapshots: a snapshot queued for persistence survives later saves, and a corrupted
in-memory snapshot is detected by its checksum and skipped with a warning naming the segment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import Checkpointer, CheckpointWarning, shm, storage
from phalanx.checkpoint import host as host_mod

pytestmark = pytest.mark.integration


def test_saves_after_a_persist_request_do_not_overwrite_the_queued_snapshot(
    host: host_mod.HostHandle, store: Path
) -> None:
    ckpt = Checkpointer()
    big = torch.randn(8 << 20)  # 32 MiB: the persist is still running while the next saves happen
    ckpt.save(1, {"w": big}, persist=True)
    for step in (2, 3, 4, 5):
        ckpt.save(step, {"w": torch.full((8 << 20,), float(step))})
    ckpt.wait()
    assert storage.committed_steps(storage.LocalStorage(store)) == [1]
    step, got = ckpt.load()  # type: ignore[misc]
    assert step == 5
    assert torch.equal(got["w"], torch.full((8 << 20,), 5.0))
    ckpt.close()
    fresh = Checkpointer(storage=str(store), shm_dir=str(store.parent))
    assert torch.equal(fresh.load()[1]["w"], big)  # type: ignore[index]


def test_corrupted_memory_snapshot_is_skipped(host: host_mod.HostHandle, job_id: str) -> None:
    ckpt = Checkpointer()
    ckpt.save(1, {"w": torch.full((1000,), 1.0)})
    ckpt.save(2, {"w": torch.full((1000,), 2.0)}, persist=True)  # persisting records the checksum
    ckpt.wait()
    ckpt.close()
    seg = next(
        s
        for s in (shm.Segment(shm.slot_path(Path("/dev/shm"), job_id, 0, i)) for i in range(2))
        if s.header().step == 2
    )
    header = seg.header()
    assert header.crc_seq == header.seq
    seg.buf[header.data_off + 100] ^= 0xFF  # a bit flip in the tensor data
    seg.close()
    restarted = Checkpointer()
    with pytest.warns(CheckpointWarning, match=str(seg.path)):
        step, got = restarted.load()  # type: ignore[misc]
    # step 2 in memory is corrupt, but step 2 is also committed on storage: that copy is loaded
    assert step == 2
    assert restarted.last_load["source"] == "storage"
    assert torch.equal(got["w"], torch.full((1000,), 2.0))
    restarted.close()
