"""The first save of an incarnation, when the sizes are known before it: a restarted process adopts the
slots its previous incarnation left with the host (mapped in the background from its construction on), and
a load readies the slots of a node that lost its memory. Real host processes, real shared memory, a real
SIGKILLed trainer."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from phalanx.api.errors import CheckpointError
from phalanx.checkpoint import Checkpointer, CheckpointWarning, shm, storage
from phalanx.checkpoint import host as host_mod
from tests.checkpoint.conftest import SHM, job_segments, worker_env

pytestmark = pytest.mark.integration

MIB = 1 << 20

# Saves steps 1 and 2 of argv[1] floats, then dies by SIGKILL as a crashing trainer does.
DYING_TRAINER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from phalanx.checkpoint import Checkpointer
    ckpt = Checkpointer()
    n = int(sys.argv[1])
    ckpt.save(1, {"w": torch.full((n,), 1.0)})
    ckpt.save(2, {"w": torch.full((n,), 2.0)})
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def run_dying_trainer(handle: host_mod.HostHandle, *, floats: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DYING_TRAINER, str(floats)],
        env=worker_env(handle),
        cwd=Path(__file__).parents[2],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]


def slot_steps(job_id: str, *, shm_dir: Path = SHM) -> dict[int, int]:
    """The step of each complete slot of rank 0, by slot index."""
    steps = {}
    for index in range(shm.SLOTS):
        seg = shm.Segment(shm.slot_path(shm_dir, job_id, 0, index))
        header = seg.header()
        if header.complete:
            steps[index] = header.step
        seg.close()
    return steps


def test_a_restarted_rank_saves_while_its_adopted_slots_are_still_being_mapped(
    host: host_mod.HostHandle, job_id: str
) -> None:
    run_dying_trainer(host, floats=4 << 20)  # 16 MiB: its mapping takes a while
    assert sorted(slot_steps(job_id).values()) == [1, 2]
    restarted = Checkpointer()
    # Adopted at construction: mapped, and its pages being mapped in the background, the slot of step 1
    # (the one the next save overwrites) first.
    assert restarted.memory.mapped is not None
    three = torch.randn(4 << 20)
    restarted.save(3, {"w": three})  # at once: the background mapping may still run
    assert restarted.last_save["allocated"] is False
    assert sorted(slot_steps(job_id).values()) == [2, 3]  # step 2 untouched by the save beside the mapping
    restarted.wait_prepared()
    restarted.close()
    again = Checkpointer()  # a second restart reads what the save beside the mapping wrote
    step, got = again.load()  # type: ignore[misc]
    assert (step, again.last_load["source"]) == (3, "memory")
    assert torch.equal(got["w"], three)
    again.save(4, {"w": three + 1})
    assert again.last_save["allocated"] is False
    again.close()


def test_a_load_from_storage_readies_the_slots_of_a_node_that_lost_its_memory(
    host: host_mod.HostHandle, job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Checkpointer()
    first.save(2, {"w": torch.full((1 << 20,), 2.0)}, persist=True)
    first.wait()
    first.close()
    host.stop()  # the node goes, with its memory
    assert not job_segments(job_id)

    # A process that only reads (no host runs) takes no shared memory and starts no host.
    reader = Checkpointer(host_socket=str(tmp_path / "no-host.sock"), local_rank=1)
    assert reader.load()[0] == 2  # type: ignore[index]
    assert "preparing" not in reader.last_load
    reader.close()
    assert not job_segments(job_id)

    replacement = host_mod.start(job_id=job_id, storage=str(store), socket_path=tmp_path / "new.sock")
    for key, value in replacement.env().items():
        monkeypatch.setenv(key, value)
    try:
        ckpt = Checkpointer()
        assert ckpt.memory.mapped is None  # nothing of this rank on the new node
        step, got = ckpt.load()  # type: ignore[misc]
        assert (step, ckpt.last_load["source"], ckpt.last_load.get("preparing")) == (2, "storage", True)
        assert torch.equal(got["w"], torch.full((1 << 20,), 2.0))
        ckpt.wait_prepared()  # training would run meanwhile
        for index in range(shm.SLOTS):
            path = shm.slot_path(SHM, job_id, 0, index)
            assert path.stat().st_size >= 4 * MIB
            assert shm.unallocated_bytes(path, path.stat().st_size) == 0  # allocated off the save
        five = torch.randn(1 << 20)
        ckpt.save(5, {"w": five})
        assert ckpt.last_save["allocated"] is False  # the first save of the new node only copied
        step, got = ckpt.load()  # type: ignore[misc]
        assert (step, ckpt.last_load["source"]) == (5, "memory")
        assert torch.equal(got["w"], five)

        # A state that outgrew the prepared slots (a shorter one was loaded) is reallocated, not truncated.
        bigger = torch.randn(2 << 20)
        ckpt.save(6, {"w": bigger}, persist=True)
        assert ckpt.last_save["allocated"] is True
        ckpt.wait()
        ckpt.close()

        # A bit flip in the snapshot written into those slots is caught by its checksum: the restarted
        # rank loads the persisted copy instead.
        slots = [shm.Segment(shm.slot_path(SHM, job_id, 0, i)) for i in range(shm.SLOTS)]
        seg = next(s for s in slots if s.header().step == 6)
        header = seg.header()
        assert header.crc_seq == header.seq
        seg.buf[header.data_off + 4096] ^= 0x01
        for s in slots:
            s.close()
        restarted = Checkpointer()
        with pytest.warns(CheckpointWarning, match="checksum"):
            step, got = restarted.load()  # type: ignore[misc]
        assert (step, restarted.last_load["source"]) == (6, "storage")
        assert torch.equal(got["w"], bigger)
        restarted.close()
        assert storage.committed_steps(storage.LocalStorage(store)) == [2, 6]
    finally:
        replacement.stop()


def test_a_prepare_that_cannot_get_its_memory_does_not_fail_a_save_that_fits(
    job_id: str, tmp_path: Path
) -> None:
    """A prepare sized from a load may ask for more than the saves then need: it fails at wait_prepared,
    not at the save, which allocates what it needs itself."""
    tmpfs = tmp_path / "small-shm"
    tmpfs.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(tmpfs)], check=False, capture_output=True
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {tmpfs}: {mounted.stderr!r}")
    try:
        handle = host_mod.start(job_id=job_id, shm_dir=tmpfs, socket_path=tmp_path / "h.sock")
        try:
            ckpt = Checkpointer(
                job_id=job_id, shm_dir=str(tmpfs), host_socket=str(handle.socket_path), rank=0, world_size=1
            )
            ckpt.prepare({"w": torch.zeros(4 << 20)})  # 16 MiB: two slots do not fit in 8 MiB
            small = torch.randn(1 << 18)  # 1 MiB: they do
            ckpt.save(1, {"w": small})
            assert ckpt.last_save["allocated"] is True
            with pytest.raises(CheckpointError, match="preparing the checkpoint memory failed"):
                ckpt.wait_prepared()
            step, got = ckpt.load()  # type: ignore[misc]
            assert step == 1
            assert torch.equal(got["w"], small)
            ckpt.close()
        finally:
            handle.stop()
    finally:
        subprocess.run(["umount", str(tmpfs)], check=True)
    assert not shm.job_files(tmpfs, job_id)


def test_a_new_job_that_loads_into_its_state_is_ready_before_its_first_save(
    host: host_mod.HostHandle, job_id: str
) -> None:
    """Nothing to load, but ``into`` tells the state's sizes: the slots are sized at the load and populated
    behind it, and the first save (while slot 1 may still be populating) only copies."""
    state = {"w": torch.randn(1 << 20), "opt": {"m": torch.randn(1 << 19)}}
    ckpt = Checkpointer()
    assert ckpt.load(into=state) is None
    assert ckpt.last_load == {"step": None, "source": None, "storage_reads": 0, "preparing": True}
    assert sorted(p.name for p in shm.job_files(SHM, job_id)) == [
        shm.slot_path(SHM, job_id, 0, i).name for i in range(shm.SLOTS)
    ]
    ckpt.save(1, state)
    assert (ckpt.last_save["allocated"], ckpt.last_save["slot"]) == (False, 0)
    ckpt.wait_prepared()
    ckpt.save(2, {"w": state["w"] * 2, "opt": state["opt"]})
    assert (ckpt.last_save["allocated"], ckpt.last_save["slot"]) == (False, 1)
    step, got = ckpt.load()  # type: ignore[misc]
    assert step == 2
    assert torch.equal(got["w"], state["w"] * 2)
    assert torch.equal(got["opt"]["m"], state["opt"]["m"])
    assert slot_steps(job_id) == {0: 1, 1: 2}
    ckpt.close()


def _train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, *, width: int = 256) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, width)).square().mean().backward()
        opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def test_a_new_process_is_prepared_from_its_optimizers_without_calling_prepare(
    host: host_mod.HostHandle, job_id: str
) -> None:
    """No prepare(): the Checkpointer readies its slots in the background at the optimizers' second step
    (when Adam's moments exist), sized for the parameters and the optimizers' state, and the first save is a
    plain copy into them; the saved state round-trips."""
    # Most of the state is the second optimizer's: slots sized for the first alone would not hold it.
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 4096))
    opt, head = torch.optim.Adam(model[0].parameters()), torch.optim.SGD(model[1].parameters(), momentum=0.9)
    ckpt = Checkpointer()
    for optimizer in (opt, head):
        _train_steps(model, optimizer, 1)
    assert ckpt.memory.mapped is None, "nothing is prepared before an optimizer's second step"
    _train_steps(model, opt, 1)
    ckpt.wait_prepared()
    assert ckpt.memory.mapped is not None
    state = _state(model, opt) | {"head": head.state_dict()}
    ckpt.save(1, state)
    assert ckpt.last_save["allocated"] is False, "the first save found its slots ready"
    loaded = ckpt.load()
    assert loaded is not None
    step, restored = loaded
    assert step == 1
    assert torch.equal(restored["model"]["0.weight"], model[0].weight.detach())
    ckpt.close()


def test_a_save_before_the_second_step_or_the_switch_off_leaves_the_save_to_size_its_slots(
    host: host_mod.HostHandle, job_id: str
) -> None:
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    off = Checkpointer(prepare_from_optimizer=False)
    _train_steps(model, opt, 3)
    assert off.memory.mapped is None, "switched off: nothing is prepared"
    off.save(1, _state(model, opt))
    assert off.last_save["allocated"] is True
    off.close(stop_host=False)

    early = torch.nn.Linear(128, 128)
    early_opt = torch.optim.Adam(early.parameters())
    ckpt = Checkpointer(job_id=f"{job_id}-early")
    _train_steps(early, early_opt, 1, width=128)
    ckpt.save(1, _state(early, early_opt))  # the save came first: it sized the slots
    assert ckpt.last_save["allocated"] is True
    mapped = ckpt.memory.mapped
    _train_steps(early, early_opt, 2, width=128)  # the second step finds slots and prepares nothing more
    ckpt.wait_prepared()
    assert ckpt.memory.mapped is mapped
    ckpt.save(2, _state(early, early_opt))
    assert ckpt.last_save["allocated"] is False
    ckpt.close()


def test_a_checkpointer_that_only_reads_another_nodes_memory_prepares_nothing_from_the_optimizer(
    host: host_mod.HostHandle, job_id: str, tmp_path: Path
) -> None:
    """A Checkpointer told to look at memory the host does not keep (another node's, in a test) is one that
    loads: the optimizers' steps neither connect it to the host nor take shared memory for it, as after a
    load (its lingering socket once warned in a later test)."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    reader = Checkpointer(shm_dir=str(tmp_path))
    _train_steps(model, opt, 3, width=64)
    reader.wait_prepared()
    assert reader.memory.mapped is None
    assert reader.host._client is None, "it never connected to the host"
    reader.close()
