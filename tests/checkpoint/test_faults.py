"""Faults injected for real: SIGKILLed trainers and hosts, corrupted files, a full disk."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from phalanx.api.errors import CheckpointCorruptError, CheckpointError, PersistError
from phalanx.checkpoint import Checkpointer, CheckpointWarning, shm, storage
from phalanx.checkpoint import host as host_mod
from tests import torch_forks
from tests.checkpoint.conftest import worker_env
from tests.eventually import eventually

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


def run_trainer(
    handle: host_mod.HostHandle,
    out: Path,
    *,
    steps: int,
    kill_after: int | None = None,
    extra: list[str] = (),
) -> list[str]:
    """Runs the training worker; with ``kill_after`` SIGKILLs it once it reported that step."""
    cmd = [sys.executable, str(HERE / "train_worker.py"), f"--steps={steps}", f"--out={out}", *extra]
    proc = torch_forks.popen(cmd, env=worker_env(handle), stdout=subprocess.PIPE, cwd=HERE.parents[1])
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if kill_after is not None and line.startswith("STEP ") and int(line.split()[1]) >= kill_after:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if kill_after is None:
        assert proc.returncode == 0, lines
    else:
        assert proc.returncode == -signal.SIGKILL
    return lines


def test_sigkilled_trainer_resumes_from_memory_bitwise(
    host: host_mod.HostHandle, tmp_path: Path, job_id: str
) -> None:
    reference_host = host_mod.start(job_id=f"{job_id}-ref", socket_path=tmp_path / "ref.sock")
    try:
        run_trainer(reference_host, tmp_path / "ref.safetensors", steps=30)
    finally:
        reference_host.stop()
    args = ["--persist-every=10", "--step-delay=0.02"]
    run_trainer(host, tmp_path / "out.safetensors", steps=30, kill_after=17, extra=args)
    lines = run_trainer(host, tmp_path / "out.safetensors", steps=30, extra=args)
    loaded = [line for line in lines if line.startswith("LOADED")]
    assert loaded, lines
    _, step, info = loaded[0].split(" ", 2)
    assert int(step) >= 17
    assert json.loads(info)["source"] == "memory"
    assert json.loads(info)["storage_reads"] == 0  # step 10 was on storage, and never read
    ref, out = load_file(str(tmp_path / "ref.safetensors")), load_file(str(tmp_path / "out.safetensors"))
    assert ref.keys() == out.keys()
    for key in ref:
        assert torch.equal(ref[key], out[key]), key


SAVER = """
import sys, torch
from phalanx.checkpoint import Checkpointer
ck = Checkpointer()
w = torch.empty(16 << 20)
blocking = sys.argv[1] == "blocking"
step = 0
while True:
    step += 1
    ck.fence()  # a save behind training must be done before the state changes
    w.fill_(float(step))
    ck.save(step, {"w": w, "step": step}, blocking=blocking)
    print(step, flush=True)
"""


@pytest.mark.parametrize("mode", ["blocking", "behind"])
def test_sigkill_during_a_save_keeps_the_previous_snapshot(
    host: host_mod.HostHandle, job_id: str, mode: str
) -> None:
    code = [sys.executable, "-c", SAVER, mode]
    proc = torch_forks.popen(code, env=worker_env(host), stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "1"
        assert proc.stdout.readline().strip() == "2"
        segs = [shm.Segment(shm.slot_path(Path("/dev/shm"), job_id, 0, s)) for s in range(2)]
        eventually(  # no pause between looks: the copy lasts only a moment
            lambda: any(s.header().state == shm.STATE_WRITING for s in segs),
            timeout=30,
            what="a save in progress",
            interval=0,
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        states = sorted(s.header().state for s in segs)
        assert states == [shm.STATE_WRITING, shm.STATE_COMPLETE]  # killed mid-copy, the other slot intact
        complete = next(s.header() for s in segs if s.header().complete)
        for s in segs:
            s.close()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    ckpt = Checkpointer()
    step, state = ckpt.load()  # type: ignore[misc]
    assert step == complete.step
    assert state["step"] == step
    assert torch.equal(state["w"], torch.full((16 << 20,), float(step)))
    ckpt.close()


def test_sigkilled_persister_commits_nothing_then_the_next_persist_commits(
    job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = host_mod.start(job_id=job_id, storage=str(store), socket_path=tmp_path / "h.sock")
    for key, value in first.env().items():
        monkeypatch.setenv(key, value)
    ckpt = Checkpointer()
    state = {"w": torch.randn(96 << 20)}  # 384 MiB: the write takes long enough to be caught midway
    ckpt.save(7, state, persist=True)
    step_dir = store / storage.step_dir(7)
    eventually(  # polled often: the write lasts a fraction of a second
        lambda: step_dir.exists() and [p for p in step_dir.iterdir() if p.name.startswith(".")],
        timeout=60,
        what="the shard being written",
        interval=0.001,
    )
    os.kill(first.pid, signal.SIGKILL)
    first.stop()
    assert not (step_dir / storage.COMMIT).exists()
    assert not (step_dir / "rank-00000.safetensors").exists()
    assert storage.committed_steps(storage.LocalStorage(store)) == []
    ckpt.close()
    second = host_mod.start(
        job_id=job_id, storage=str(store), socket_path=tmp_path / "h.sock"
    )  # adopts the memory
    try:
        ckpt = Checkpointer()
        # The killed persister's pin is gone: it would keep step 7's slot from every later save, and
        # make every later persist wait for a persister that no longer exists.
        assert not any(seg.header().pin for seg in ckpt.memory_slots(0))
        ckpt.persist(7)
        ckpt.wait()
        assert storage.committed_steps(storage.LocalStorage(store)) == [7]
        later = {"w": state["w"] + 1}
        ckpt.save(8, later, persist=True)
        ckpt.wait()
        assert storage.committed_steps(storage.LocalStorage(store)) == [7, 8]
        ckpt.close()
    finally:
        second.stop()
    fresh = Checkpointer(storage=str(store), shm_dir=str(tmp_path))
    step, got = fresh.load()  # type: ignore[misc]
    assert step == 8
    assert torch.equal(got["w"], later["w"])


def stop_process(pid: int) -> None:
    """SIGSTOPs ``pid`` and returns once it is stopped (the signal is only queued when kill returns)."""
    os.kill(pid, signal.SIGSTOP)
    eventually(
        lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"),
        timeout=10,
        what=f"pid {pid} stopping",
        interval=0.001,
    )


def test_a_host_that_hangs_or_dies_costs_a_persist_never_training(
    job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host is SIGSTOPped, then SIGKILLed and replaced the way its agent replaces it. Saves with a persist
    request return at memory speed all along; the requests the host could not take are reported (by wait,
    or the next persist), and once a new host runs the next persist commits."""
    sock = tmp_path / "h.sock"

    def start() -> host_mod.HostHandle:
        return host_mod.start(job_id=job_id, storage=str(store), socket_path=sock)

    first = start()
    for key, value in first.env().items():
        monkeypatch.setenv(key, value)
    ckpt = Checkpointer()
    ckpt.call_limit_s = 1.0
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    ckpt.save(1, weights, persist=True)
    assert [r["step"] for r in ckpt.wait()] == [1]
    hosts = [first]
    try:
        stop_process(first.pid)
        started = time.monotonic()
        ckpt.save(2, {"w": weights["w"] + 2}, persist=True)
        ckpt.save(3, {"w": weights["w"] + 3}, persist=True)
        assert time.monotonic() - started < 0.5  # the requests wait on a thread of their own
        assert sorted(seg.header().step for seg in ckpt.memory_slots(0) if seg.header().complete) == [2, 3]
        refused = r"step 2 \(.*did not answer 'persist' in 1.0s\); step 3 \(.*has not been replaced yet\)"
        with pytest.raises(PersistError, match=refused):
            ckpt.wait()
        assert time.monotonic() - started < 2.5  # one call limit: step 3 was not sent to the silent host
        assert not any(seg.header().pin for seg in ckpt.memory_slots(0))  # both slots free for the saves

        first.kill()  # what the agent does to a host that does not answer
        hosts.append(start())  # adopts the node's memory
        ckpt.save(4, {"w": weights["w"] + 4}, persist=True)
        assert [r["step"] for r in ckpt.wait()] == [4]
        assert storage.committed_steps(storage.LocalStorage(store)) == [1, 4]

        hosts[-1].kill()
        ckpt.save(5, {"w": weights["w"] + 5}, persist=True)  # nobody replaced it yet
        with pytest.raises(PersistError, match=r"step 5 \(cannot reach the checkpoint host"):
            ckpt.wait()
        hosts.append(start())
        ckpt.save(6, {"w": weights["w"] + 6}, persist=True)
        assert [r["step"] for r in ckpt.wait()] == [6]
        ckpt.close()
        fresh = Checkpointer(storage=str(store), shm_dir=str(tmp_path))
        step, got = fresh.load()  # type: ignore[misc]
        assert step == 6
        assert torch.equal(got["w"], weights["w"] + 6)
    finally:
        for handle in hosts:
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.SIGCONT)
        hosts[-1].stop()


def test_a_persist_taken_by_a_host_that_went_away_is_reported_lost(
    job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host took the persist of step 5 and wrote this rank's shard, but the step is not committed (the
    other rank has not persisted it) when the host is SIGKILLed: its replacement never heard of it."""
    sock = tmp_path / "h.sock"
    first = host_mod.start(job_id=job_id, storage=str(store), socket_path=sock)
    for key, value in first.env().items():
        monkeypatch.setenv(key, value)
    ckpt = Checkpointer(rank=0, world_size=2)
    ckpt.save(5, {"w": torch.ones(1024)}, persist=True)
    (slot,) = [seg for seg in ckpt.memory_slots(0) if seg.header().step == 5]
    eventually(
        lambda: not slot.header().pin and (store / storage.manifest_file(5, 0)).exists(),
        timeout=30,
        what="the host persisting the shard",
        interval=0.005,
    )
    first.kill()
    second = host_mod.start(job_id=job_id, storage=str(store), socket_path=sock)
    try:
        with pytest.raises(PersistError, match=r"steps \[5\] were taken by a checkpoint host that went"):
            ckpt.wait()
        assert ckpt.wait() == []  # reported once
        ckpt.close()
    finally:
        second.stop()


def test_a_save_never_waits_for_storage_and_a_waiting_persist_gives_way(
    host: host_mod.HostHandle, store: Path
) -> None:
    """Storage slower than the persist interval: the persister writes step 2 while the persist of step 3
    waits for its turn (the pins are set as the persister and persist() set them). Step 4's save takes
    step 3's slot, never step 2's, and the host reports step 3 as superseded, not as a failure."""
    ckpt = Checkpointer()
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((1024,), float(step))})
    slots = {seg.header().step: seg for seg in ckpt.memory_slots(0)}
    assert sorted(slots) == [2, 3]
    shm.set_pin(slots[2].buf, shm.PIN_WRITING)
    shm.set_pin(slots[3].buf, shm.PIN_QUEUED)
    ckpt.save(4, {"w": torch.full((1024,), 4.0)})
    assert (slots[2].header().step, slots[2].header().complete) == (2, True)  # the persister's read is safe
    assert slots[3].header().step == 4
    reply = ckpt.client().call({"op": "persist", "rank": 0, "step": 3})
    assert reply["ok"], reply
    done = ckpt.client().call({"op": "wait", "rank": 0, "step": None})
    assert done["ok"], done
    assert [(r["step"], r.get("skipped")) for r in done["results"]] == [
        (3, "step 3 was superseded by step 4 before it was persisted")
    ]
    shm.set_pin(slots[2].buf, 0)  # the persister is done with step 2
    ckpt.save(5, {"w": torch.full((1024,), 5.0)}, persist=True)
    assert [r["step"] for r in ckpt.wait()] == [5]
    assert storage.committed_steps(storage.LocalStorage(store)) == [5]
    ckpt.close()


def test_a_persist_overtaken_by_a_save_still_copying_is_superseded_not_failed(
    host: host_mod.HostHandle, store: Path
) -> None:
    """As above, but the persister reaches step 3 while step 4's copy into its slot is still running (a
    save behind training: on a GPU its copy can outlast several steps): step 3 is reported superseded by
    step 4, not as a failure the master would show as an event."""
    ckpt = Checkpointer()
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((1024,), float(step))})
    slots = {seg.header().step: seg for seg in ckpt.memory_slots(0)}
    shm.set_pin(slots[2].buf, shm.PIN_WRITING)
    shm.set_pin(slots[3].buf, shm.PIN_QUEUED)
    ckpt.save(4, {"w": torch.full((1024,), 4.0)})
    taken = slots[3].header()
    assert taken.step == 4
    # What save() writes before it starts copying; the copy's end writes the complete header.
    shm.pack_header(
        slots[3].buf,
        shm.SlotHeader(state=shm.STATE_WRITING, seq=taken.seq, step=4, rank=0, world_size=1),
    )
    reply = ckpt.client().call({"op": "persist", "rank": 0, "step": 3})
    assert reply["ok"], reply
    done = ckpt.client().call({"op": "wait", "rank": 0, "step": None})
    assert done["ok"], done
    assert [(r["step"], r.get("skipped"), r.get("error")) for r in done["results"]] == [
        (3, "step 3 was superseded by step 4 before it was persisted", None)
    ]
    shm.set_pin(slots[2].buf, 0)
    ckpt.close()


def test_corrupt_persisted_file_falls_back_with_a_warning(
    host: host_mod.HostHandle, store: Path, tmp_path: Path
) -> None:
    ckpt = Checkpointer()
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((1000,), float(step))}, persist=True)
        ckpt.wait()
    ckpt.close()
    bad = store / storage.shard_file(2, 0)
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF
    bad.write_bytes(bytes(data))
    fresh = Checkpointer(storage=str(store), shm_dir=str(tmp_path))
    with pytest.warns(CheckpointWarning, match=str(bad)):
        step, got = fresh.load()  # type: ignore[misc]
    assert step == 1
    assert torch.equal(got["w"], torch.full((1000,), 1.0))
    first = store / storage.shard_file(1, 0)
    first.write_bytes(first.read_bytes()[:-1])
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointCorruptError):
        fresh.load()


@contextlib.contextmanager
def small_tmpfs(mount: Path, *, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``mount`` (tests run as root), unmounted afterwards."""
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=False, capture_output=True
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a {size} tmpfs at {mount}: {done.stderr!r}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a real full disk."""
    with small_tmpfs(tmp_path / "tiny", size="2m") as mount:
        yield mount


def test_full_disk_is_a_clear_persist_error_and_training_goes_on(
    job_id: str, tiny_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = host_mod.start(job_id=job_id, storage=str(tiny_disk), socket_path=tmp_path / "h.sock")
    for key, value in handle.env().items():
        monkeypatch.setenv(key, value)
    try:
        ckpt = Checkpointer()
        ckpt.save(1, {"w": torch.full((1 << 20,), 1.0)}, persist=True)  # 4 MiB onto 2 MiB
        with pytest.raises(PersistError, match="No space left"):
            ckpt.wait()
        assert storage.committed_steps(storage.LocalStorage(tiny_disk)) == []
        assert not list((tiny_disk / storage.step_dir(1)).iterdir())  # the temporary file is gone too
        ckpt.save(2, {"w": torch.full((1 << 20,), 2.0)})  # training goes on
        step, got = ckpt.load()  # type: ignore[misc]
        assert step == 2
        assert torch.equal(got["w"], torch.full((1 << 20,), 2.0))
        ckpt.close()
    finally:
        handle.stop()


def test_persisting_where_the_host_cannot_is_refused_at_the_first_persist(
    job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer given a storage location of its own, on a node whose agent's host has none or another
    one: the first persist says what to fix, and the snapshot it was saving stays in memory."""
    bare = host_mod.start(job_id=job_id, socket_path=tmp_path / "bare.sock")  # an agent without storage
    for key, value in bare.env().items():
        monkeypatch.setenv(key, value)
    try:
        ckpt = Checkpointer(storage=str(store))
        with pytest.raises(PersistError, match=r"has no storage.*--checkpoint-dir " + str(store)):
            ckpt.save(10, {"w": torch.full((256,), 10.0)}, persist=True)
        assert ckpt.load()[0] == 10  # type: ignore[index]
        assert not list(store.iterdir())
        ckpt.close()
    finally:
        bare.stop()

    elsewhere = tmp_path / "elsewhere"
    other = host_mod.start(job_id=job_id, storage=str(elsewhere), socket_path=tmp_path / "other.sock")
    for key, value in other.env().items():
        monkeypatch.setenv(key, value)
    try:
        ckpt = Checkpointer(storage=str(store))
        with pytest.raises(
            PersistError, match=f"persists to {elsewhere}, but this process loads from {store}"
        ):
            ckpt.save(11, {"w": torch.full((256,), 11.0)}, persist=True)
        assert ckpt.load()[0] == 11  # type: ignore[index]
        ckpt.close()
    finally:
        other.stop()
    assert not elsewhere.exists() or not list(elsewhere.iterdir())


def test_the_same_storage_spelled_another_way_persists(
    job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = host_mod.start(job_id=job_id, storage=f"file://{store}/", socket_path=tmp_path / "h.sock")
    for key, value in handle.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(store.parent)
    try:
        ckpt = Checkpointer(storage=f"./{store.name}")
        ckpt.save(3, {"w": torch.full((256,), 3.0)}, persist=True)
        assert [r["step"] for r in ckpt.wait()] == [3]
        assert storage.committed_steps(storage.LocalStorage(store)) == [3]
        ckpt.close()
    finally:
        handle.stop()


@pytest.fixture
def tiny_shm(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs standing in for a node's /dev/shm that is too small."""
    with small_tmpfs(tmp_path / "tiny-shm", size="8m") as mount:
        yield mount


def test_full_shared_memory_is_a_clear_error_and_the_last_snapshot_survives(
    job_id: str, tiny_shm: Path, tmp_path: Path
) -> None:
    handle = host_mod.start(job_id=job_id, shm_dir=tiny_shm, socket_path=tmp_path / "h.sock")
    try:
        ckpt = Checkpointer(
            job_id=job_id, shm_dir=str(tiny_shm), host_socket=str(handle.socket_path), rank=0, world_size=1
        )
        ckpt.save(1, {"w": torch.full((1 << 18,), 1.0)})  # 1 MiB: two slots fit in 8 MiB
        ckpt.wait_prepared()  # the other slot, populated in the background after this first save
        with pytest.raises(CheckpointError, match="give the node more shared memory"):
            ckpt.save(2, {"w": torch.full((1 << 20,), 2.0)})  # 4 MiB: two slots do not
        step, got = ckpt.load()  # type: ignore[misc]
        assert step == 1
        assert torch.equal(got["w"], torch.full((1 << 18,), 1.0))

        # Slots sized earlier whose memory is gone by the time a rank writes them (another rank or a data
        # loader filled the tmpfs): the save fails with the same clear error instead of dying of SIGBUS.
        for slot in range(shm.SLOTS):
            shm.create(shm.slot_path(tiny_shm, job_id, 1, slot), 6 << 20)
        other = Checkpointer(
            job_id=job_id, shm_dir=str(tiny_shm), host_socket=str(handle.socket_path), rank=1, world_size=2
        )
        with pytest.raises(CheckpointError, match="give the node more shared memory"):
            other.save(1, {"w": torch.full((1 << 20,), 3.0)})
        other.close()
        ckpt.save(3, {"w": torch.full((1 << 18,), 3.0)})  # training goes on in the memory it has
        assert ckpt.load()[0] == 3  # type: ignore[index]
        ckpt.close()
    finally:
        handle.stop()
    assert not shm.job_files(tiny_shm, job_id)
