"""The trainer's checkpoint seam on the flash checkpoint, with a real checkpoint host and real shared
memory: memory reads after a process restart, storage reads on a node without the snapshot, and both
ways of getting a host (advertised by the agent in the environment, or started by local rank 0)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from phalanx.api.errors import CheckpointNotFoundError
from phalanx.checkpoint import Checkpointer, protocol, shm
from phalanx.checkpoint import host as host_mod
from phalanx.trainer.checkpointing import shard_key
from phalanx.trainer.elastic import ElasticConfig, ElasticTrainer
from phalanx.trainer.engine import Engine
from phalanx.trainer.flash import FlashCheckpoint, shard_index
from phalanx.trainer.mesh import ParallelConfig
from phalanx.trainer.model import GPTConfig

MESH = ParallelConfig(tensor=2, pipeline=2)
KEYS = [shard_key(pipeline=p, tensor=t) for p in range(2) for t in range(2)]


def _state(step: int, key: str) -> dict[str, torch.Tensor]:
    seed = step * 10 + shard_index(key, parallel=MESH)
    return {"w": torch.full((3, 4), float(seed)), "adam.step": torch.tensor([seed], dtype=torch.int64)}


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Unique job ids; each job's self-started host is stopped (unlinking its memory) at the end."""
    for name in (protocol.ENV_SOCKET, protocol.ENV_SHM_DIR, protocol.ENV_JOB, protocol.ENV_STORAGE):
        monkeypatch.delenv(name, raising=False)
    made: list[str] = []
    yield made
    for job in made:
        Checkpointer(job_id=job, local_rank=1).close(stop_host=True)


def test_shard_index_is_dense_over_the_mesh() -> None:
    assert [shard_index(k, parallel=MESH) for k in KEYS] == [0, 1, 2, 3]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_restart_reads_memory_and_another_node_reads_storage(tmp_path: Path, jobs: list[str]) -> None:
    node_a, node_b = f"tf-{uuid.uuid4().hex[:8]}-a", f"tf-{uuid.uuid4().hex[:8]}-b"
    jobs.extend([node_a, node_b])
    store = str(tmp_path / "store")
    # No host in the environment: local rank 0 starts the node's host (detached).
    first = FlashCheckpoint(parallel=MESH, storage_location=store, local_rank=0, job_id=node_a)
    for step in (5, 10):
        for key in KEYS:
            first.save(step=step, key=key, tensors=_state(step, key))
    first.close()  # waits until every shard of both steps is persisted
    assert first.last_save_s > 0

    # A restarted process on the same node: the host outlived the old one, the memory holds both steps.
    again = FlashCheckpoint(parallel=MESH, storage_location=store, local_rank=0, job_id=node_a)
    assert again.steps(key="pp1-tp0") == [10, 5]
    loaded = again.load(step=10, key="pp1-tp0")
    assert again.last_source == "memory"
    assert torch.equal(loaded["w"], _state(10, "pp1-tp0")["w"])
    assert torch.equal(loaded["adam.step"], _state(10, "pp1-tp0")["adam.step"])
    again.close()

    # A process on another node (its own host, empty memory) reads the committed steps from storage.
    other = FlashCheckpoint(parallel=MESH, storage_location=store, local_rank=0, job_id=node_b)
    assert other.steps(key="pp0-tp1") == [10, 5]
    loaded = other.load(step=5, key="pp0-tp1")
    assert other.last_source == "storage"
    assert torch.equal(loaded["w"], _state(5, "pp0-tp1")["w"])
    with pytest.raises(CheckpointNotFoundError):
        other.load(step=7, key="pp0-tp1")
    other.close()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_uses_the_host_the_agent_advertises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = f"tf-{uuid.uuid4().hex[:8]}"
    handle = host_mod.start(job_id=job, storage="", keep_last=2, socket_path=tmp_path / "agent-host.sock")
    try:
        for name, value in handle.env().items():
            monkeypatch.setenv(name, value)
        # Local rank 1 saves: with the agent's host it only connects (nobody else has to start one).
        ckpt = FlashCheckpoint(parallel=ParallelConfig(), local_rank=1)
        assert ckpt.storage_location == ""  # memory only: the agent configured no storage
        ckpt.save(step=3, key="pp0-tp0", tensors=_state(3, "pp0-tp0"))
        assert ckpt.steps(key="pp0-tp0") == [3]
        assert torch.equal(ckpt.load(step=3, key="pp0-tp0")["w"], _state(3, "pp0-tp0")["w"])
        assert ckpt.last_source == "memory"
        ckpt.close()
    finally:
        handle.stop()
    assert not shm.job_files(Path(handle.env()[protocol.ENV_SHM_DIR]), job)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_prepare_allocates_before_the_first_save(jobs: list[str]) -> None:
    job = f"tf-{uuid.uuid4().hex[:8]}"
    jobs.append(job)
    ckpt = FlashCheckpoint(parallel=MESH, local_rank=0, job_id=job)
    tensors = {"w": torch.randn(256, 1024), "adam.exp_avg": torch.randn(256, 1024)}
    ckpt.prepare(key="pp1-tp1", tensors=tensors)
    saver = ckpt._ckpt("pp1-tp1")
    saver.wait_prepared()  # the trainer does not wait; training steps run meanwhile
    slots = sorted(shm.private_dir(Path("/dev/shm")).glob(f"phx-{job}-r3-s*"))
    assert len(slots) == 2
    assert all(p.stat().st_size > 2 * 256 * 1024 * 4 for p in slots)
    ckpt.save(step=1, key="pp1-tp1", tensors=tensors)
    assert saver.last_save["allocated"] is False  # the first save only copied
    unprepared = ckpt._ckpt("pp0-tp0")
    ckpt.save(step=1, key="pp0-tp0", tensors=tensors)
    assert unprepared.last_save["allocated"] is True
    assert torch.equal(ckpt.load(step=1, key="pp1-tp1")["w"], tensors["w"])
    ckpt.close()


def _batches(step: int) -> torch.Tensor:
    """A deterministic global batch of the small model's shape (vocab 32, 8 tokens + the next one)."""
    return torch.randint(0, 32, (6, 9), generator=torch.Generator().manual_seed(step))


SMALL = ElasticConfig(
    model=GPTConfig(layers=1, hidden=32, heads=2, vocab=32, seq_len=8), global_batch=6, checkpoint_every=1
)


class _BehindSeam:
    """A seam that, like a save behind training, keeps reading the saved tensors until its fence: the
    fence checks that they still hold the values they had at the save (no update ran in between)."""

    def __init__(self) -> None:
        self.last_source = "memory"
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.log: list[str] = []

    def prepare(self, *, key: str, tensors: dict[str, torch.Tensor]) -> None:
        del key, tensors

    def save(self, *, step: int, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
        self.pending = [(t, t.clone()) for t in tensors.values()]
        self.log.append(f"save {step}")
        return {}

    def fence(self) -> None:
        if self.pending:
            changed = sum(not torch.equal(t, at_save) for t, at_save in self.pending)
            self.log.append(f"fence changed={changed}")
        self.pending = []

    def steps(self, *, key: str) -> list[int]:
        return []

    def load(
        self, *, step: int, key: str, into: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        raise CheckpointNotFoundError(key)


def test_the_trainer_fences_a_save_before_the_update_that_changes_its_tensors() -> None:
    seam = _BehindSeam()
    trainer = ElasticTrainer(SMALL, batches=_batches, checkpoint=seam)
    assert trainer.run(3) == 0
    # Each save is fenced in the next step, after its forward and backward and before its optimizer
    # update; the last one when the run ends.
    assert seam.log == ["save 1", "fence changed=0", "save 2", "fence changed=0", "save 3", "fence changed=0"]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_saves_behind_training_hold_their_own_steps_state_bitwise(jobs: list[str]) -> None:
    job = f"tf-{uuid.uuid4().hex[:8]}"
    jobs.append(job)
    ckpt = FlashCheckpoint(parallel=ParallelConfig(), local_rank=0, job_id=job, behind=True)
    events: list[dict[str, object]] = []
    trainer = ElasticTrainer(SMALL, batches=_batches, checkpoint=ckpt, on_event=events.append)
    assert trainer.run(4) == 0
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert [(e["step"], e["behind"]) for e in saves] == [(s, True) for s in (1, 2, 3, 4)]
    assert not [e for e in events if e["event"] == "checkpoint_failed"]
    # The run ended with a fence: the last snapshot is complete, and it is the final state.
    saver = ckpt._ckpt("pp0-tp0")
    assert sorted(seg.header().step for seg in saver.memory_slots(0) if seg.header().complete) == [3, 4]
    assert trainer.engine is not None
    _assert_state_equal(ckpt.load(step=4, key="pp0-tp0"), trainer.engine)
    # Step 3's snapshot was copied while step 4 ran its forward and backward: it is step 3's state.
    reference = ElasticTrainer(SMALL, batches=_batches)
    assert reference.run(3) == 0
    assert reference.engine is not None
    _assert_state_equal(ckpt.load(step=3, key="pp0-tp0"), reference.engine)
    ckpt.close()


def _assert_state_equal(loaded: dict[str, torch.Tensor], engine: Engine) -> None:
    expected = dict(engine.state_tensors())
    assert sorted(loaded) == sorted(expected)
    unequal = [name for name, t in expected.items() if not torch.equal(loaded[name], t)]
    assert not unequal, f"differ from the trained state: {unequal}"
