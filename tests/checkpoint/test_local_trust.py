"""Local trust and nothing mixed, proven by attack with real shared memory, sockets and processes: planted
symlinks and directories, a client of another user, two jobs of one name in two namespaces, shards of one
step from two rounds, a storage path used by two jobs.

The tests that act as another user run a child process as uid 10001 (the suite runs as root here); they
are skipped, saying why, when the suite does not run as root."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from phalanx.agent import checkpointing
from phalanx.api.errors import CheckpointError, PersistError
from phalanx.checkpoint import Checkpointer, protocol, shm, storage
from phalanx.checkpoint import host as host_mod
from tests.eventually import eventually

OTHER_UID = 10001
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as another user (uid 10001) needs root to setuid the child"
)


def as_other_user(action: Callable[[], str]) -> str:
    """Runs ``action`` in a forked child that has become uid/gid 10001 (a real setuid: the kernel sees
    another user); returns what it returned, or raises what it raised, as text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the action, then _exit (no pytest teardown in here)
        os.close(read_end)
        code = 0
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            out = action()
        except BaseException as exc:
            out, code = f"{type(exc).__name__}: {exc}", 1
        os.write(write_end, out.encode())
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        out = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(f"as uid {OTHER_UID}: {out}")
    return out


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A world-writable sticky directory in the real /dev/shm, as /dev/shm itself is: another user can
    create names in it."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="phx-trust-"))
    root.chmod(0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------
# The user's directory and its files


def test_checkpoint_files_and_their_directory_are_owner_only(
    host: host_mod.HostHandle, job_id: str, store: Path
) -> None:
    ckpt = Checkpointer(rank=0, world_size=1)
    ckpt.save(1, {"w": torch.ones(1024)}, persist=True)
    ckpt.wait()
    ckpt.close()
    persisted = [p for p in store.rglob("*") if p.is_file()]
    assert len(persisted) == 4  # the shard, its manifest, COMMIT and the job's claim
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in persisted), [
        oct(p.stat().st_mode) for p in persisted
    ]
    directory = shm.private_dir(host.shm_dir)
    assert directory.stat().st_mode & 0o777 == 0o700
    slots = shm.list_job_slots(host.shm_dir, job_id)[0]
    assert [p.parent for p in slots] == [directory, directory]
    assert all(p.stat().st_mode & 0o777 == 0o600 and p.stat().st_uid == os.geteuid() for p in slots)


def test_a_symlink_planted_at_a_slot_path_is_never_followed(
    host: host_mod.HostHandle, job_id: str, tmp_path: Path
) -> None:
    """A name in the shared-memory directory pointing at a file of the user's: the host neither grows nor
    writes it, and the rank gets a clear error instead of mapping it."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = shm.slot_path(host.shm_dir, job_id, 0, 0)
    planted.symlink_to(victim)
    try:
        with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP, never the target
            shm.create(planted, 1 << 20)
        with pytest.raises(OSError):
            shm.Segment(planted)
        with contextlib.closing(protocol.HostClient(str(host.socket_path))) as client:
            reply = client.call({"op": "alloc", "rank": 0, "size": 1 << 20})
        assert not reply["ok"]
        assert "cannot allocate" in reply["error"], reply
        assert victim.read_bytes() == b"precious"
    finally:
        planted.unlink()


def test_a_symlink_planted_at_the_socket_path_is_never_followed(tmp_path: Path) -> None:
    job = f"sock-{os.getpid()}"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = protocol.socket_path(job)
    shm.check_private_dir(path.parent)
    path.symlink_to(victim)
    handle = host_mod.start(job_id=job)  # the default place: the user's socket directory
    try:
        assert handle.socket_path == path
        assert path.is_socket()
        assert path.stat().st_mode & 0o777 == 0o600
        assert victim.read_bytes() == b"precious"
    finally:
        handle.stop()


def test_a_shared_memory_file_of_another_owner_or_mode_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    path = shm.slot_path(root, "j", 0, 0)
    shm.check_private_dir(path.parent)
    shm.create(path, 1 << 16)
    path.chmod(0o644)
    with pytest.raises(shm.UnsafePathError, match="not owner-only"):
        shm.Segment(path)
    if os.geteuid() == 0:
        path.chmod(0o600)
        os.chown(path, OTHER_UID, OTHER_UID)
        with pytest.raises(shm.UnsafePathError, match=f"belongs to uid {OTHER_UID}"):
            shm.create(path, 1 << 16)


def test_a_group_or_world_writable_directory_is_refused(tmp_path: Path) -> None:
    directory = shm.private_dir(tmp_path)
    directory.mkdir(mode=0o700)
    directory.chmod(0o777)
    with pytest.raises(shm.UnsafePathError, match="lets other users write"):
        shm.check_private_dir(directory)
    directory.chmod(0o750)  # ours and only readable by the group: tightened, not refused
    shm.check_private_dir(directory)
    assert directory.stat().st_mode & 0o777 == 0o700


@as_root
def test_a_directory_another_user_created_first_is_refused(shared_root: Path, tmp_path: Path) -> None:
    """uid 10001 creates this user's directory name in the shared root before the host does (to read the
    snapshots, or to plant slots): the host refuses to start, and says who owns it."""
    mine = shm.private_dir(shared_root)

    def plant() -> str:
        os.mkdir(mine, 0o777)
        os.chmod(mine, 0o777)
        return ""

    as_other_user(plant)
    assert mine.stat().st_uid == OTHER_UID
    with pytest.raises(shm.UnsafePathError, match=f"belongs to uid {OTHER_UID}"):
        shm.check_private_dir(mine)
    with pytest.raises(CheckpointError, match=f"belongs to uid {OTHER_UID}"):
        host_mod.start(job_id=f"planted-{os.getpid()}", shm_dir=shared_root, socket_path=tmp_path / "h.sock")
    assert list(mine.iterdir()) == []  # nothing of this user's was written into it


@as_root
def test_a_socket_directory_another_user_created_first_is_refused(
    shared_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with the socket's directory in the temporary directory (world-writable, like /tmp)."""
    monkeypatch.setenv("TMPDIR", str(shared_root))  # the host process's temporary directory
    monkeypatch.setattr(tempfile, "tempdir", str(shared_root))  # and this one's
    planted = protocol.socket_dir()
    assert planted.parent == shared_root

    def plant() -> str:
        os.mkdir(planted, 0o755)
        return ""

    as_other_user(plant)
    with pytest.raises(CheckpointError, match=f"{planted}: it belongs to uid {OTHER_UID}"):
        host_mod.start(job_id=f"planted-sock-{os.getpid()}", shm_dir=tmp_path)


# ------------------------------------------------------------------------------------------------------
# The host's peer


@as_root
def test_the_host_answers_only_its_own_user(tmp_path: Path) -> None:
    """A socket another user can reach (a caller put it in an open directory and opened its mode): the
    host still closes a connection from uid 10001 without answering, and answers its own user."""
    open_dir = Path(tempfile.mkdtemp(prefix="phx-open-"))
    open_dir.chmod(0o755)
    try:
        handle = host_mod.start(job_id=f"peer-{os.getpid()}", socket_path=open_dir / "h.sock")
        try:
            handle.socket_path.chmod(0o777)

            def ping() -> str:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(handle.socket_path))
                    s.settimeout(5)
                    try:  # the host may close it before the request is even sent
                        s.sendall(b'{"op":"ping"}\n')
                        return repr(s.recv(4096))
                    except OSError as exc:
                        return repr(exc)

            answer = as_other_user(ping)
            assert "pid" not in answer, answer  # closed unanswered
            with contextlib.closing(protocol.HostClient(str(handle.socket_path))) as client:
                assert client.call({"op": "ping"}, timeout_s=5)["pid"] == handle.pid
        finally:
            handle.stop()
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


@as_root
def test_a_client_talks_only_to_a_host_of_its_own_user(tmp_path: Path) -> None:
    """Whoever binds a socket at the host's path as another user (uid 10001) does not get a training
    process's requests: the client reads the server's uid (SO_PEERCRED) and refuses it."""
    open_dir = Path(tempfile.mkdtemp(prefix="phx-open-"))
    open_dir.chmod(0o777)
    path = open_dir / "h.sock"

    def impostor() -> str:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(open_dir / "binding"))
            server.listen(1)
            os.rename(open_dir / "binding", path)  # appears only once it listens
            server.settimeout(20)
            conn, _ = server.accept()
            conn.close()
        return "accepted"

    answered: list[str] = []
    thread = threading.Thread(target=lambda: answered.append(as_other_user(impostor)))
    thread.start()
    try:
        eventually(path.exists, timeout=10, what="the impostor's socket")
        with pytest.raises(CheckpointError, match=r"runs as uid 10001, not as this user"):
            protocol.HostClient(str(path))
        thread.join(20)
        assert answered == ["accepted"]
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


def test_peer_allowed() -> None:
    assert protocol.peer_allowed(1000, 1000)
    assert protocol.peer_allowed(0, 1000)
    assert not protocol.peer_allowed(1001, 1000)
    assert not protocol.peer_allowed(-1, 1000)


# ------------------------------------------------------------------------------------------------------
# One socket and one set of files per job, whatever its name


def test_two_jobs_of_one_name_in_two_namespaces_get_two_sockets_and_two_hosts(tmp_path: Path) -> None:
    """Kubernetes jobs ``tiny`` in namespaces a and b, with Pods of the same name on one node: both hosts
    run side by side (sharing a socket, the second would have taken the first's over)."""
    node = f"tiny-worker-{os.getpid()}"
    jobs = [checkpointing.node_job_id(job_id="tiny", node_id=node, scope=ns) for ns in ("a", "b")]
    paths = [checkpointing.node_socket_path(job_id="tiny", node_id=node, scope=ns) for ns in ("a", "b")]
    assert jobs[0] != jobs[1]
    assert paths[0] != paths[1]
    assert shm.slot_path(tmp_path, jobs[0], 0, 0) != shm.slot_path(tmp_path, jobs[1], 0, 0)
    handles = [host_mod.start(job_id=j, shm_dir=tmp_path, socket_path=p) for j, p in zip(jobs, paths)]
    try:
        pids = []
        for handle in handles:
            with contextlib.closing(protocol.HostClient(str(handle.socket_path))) as client:
                pids.append(client.call({"op": "ping"}, timeout_s=5)["pid"])
        assert pids == [h.pid for h in handles]
        assert all(h.alive() for h in handles)
    finally:
        for handle in handles:
            handle.stop()


def test_the_namespace_and_uid_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(protocol.ENV_JOB_UID, raising=False)
    monkeypatch.setenv(protocol.ENV_NAMESPACE, "a")
    in_a = checkpointing.node_socket_path(job_id="tiny", node_id="n")
    monkeypatch.setenv(protocol.ENV_NAMESPACE, "b")
    assert checkpointing.node_socket_path(job_id="tiny", node_id="n") != in_a
    monkeypatch.setenv(protocol.ENV_JOB_UID, "0f4b6a51-1c1e-4f7e-9c51-2b7d2a1e9a10")
    assert "0f4b6a51" in checkpointing.node_job_id(job_id="tiny", node_id="n")
    env = {"PHALANX_JOB_ID": "tiny", protocol.ENV_NAMESPACE: "a", protocol.ENV_JOB_UID: "u1"}
    assert protocol.job_identity(env, fallback="x") == ("a/tiny", "u1")
    assert protocol.job_identity({}, fallback="x") == ("x", "")


def test_a_socket_path_always_fits_a_socket_address() -> None:
    longest = checkpointing.node_socket_path(job_id="j" * 63, node_id="p" * 253, scope="u" * 36)
    other = checkpointing.node_socket_path(job_id="j" * 63, node_id="p" * 252 + "q", scope="u" * 36)
    assert len(os.fsencode(longest)) <= protocol.MAX_SOCKET_PATH
    assert longest != other
    assert longest.parent == protocol.socket_dir()
    long_job = "x" * 300
    assert len(shm.slot_path(Path("/dev/shm"), long_job, 0, 0).name) < 200
    assert shm.sanitize_job(long_job) != shm.sanitize_job(long_job[:-1] + "y")


# ------------------------------------------------------------------------------------------------------
# Nothing mixed


def test_mixed_saves_names_the_saves_that_differ() -> None:
    one = storage.save_id(job="ns/tiny", uid="u", round_no=3, step=10)
    other = storage.save_id(job="ns/tiny", uid="u", round_no=4, step=10)
    assert storage.mixed_saves({0: one, 1: dict(one)}) == ""
    why = storage.mixed_saves({0: one, 1: other})
    assert "ranks [0]" in why
    assert '"round": 4' in why
    assert storage.mixed_saves({0: one, 1: None})


def test_a_step_saved_in_two_rounds_is_never_committed(
    host: host_mod.HostHandle, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 persisted step 2 in round 3 and its round died; rank 1 of round 4 reached step 2 again. Both
    shards are there, but they are not one checkpoint: no COMMIT, the error says why, and step 1 still
    loads. Once round 4's rank 0 persists its step 2 too, the step is committed."""
    monkeypatch.delenv("PHALANX_ROUND_FILE", raising=False)
    ranks = [Checkpointer(rank=r, world_size=2) for r in range(2)]
    for r, ckpt in enumerate(ranks):
        ckpt.save(1, {"w": torch.full((256,), float(r))}, persist=True)
    for ckpt in ranks:
        ckpt.wait()
    assert storage.committed_steps(storage.open_storage(str(store))) == [1]

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    ranks[0].save(2, {"w": torch.full((256,), 30.0)}, persist=True)
    ranks[0].wait()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    ranks[1].save(2, {"w": torch.full((256,), 41.0)}, persist=True)
    results = ranks[1].wait()
    assert storage.committed_steps(storage.open_storage(str(store))) == [1]
    why = results[0]["not_committed"]
    assert "different saves" in why
    assert '"round": 3' in why

    fresh = Checkpointer(rank=1, world_size=2, storage=str(store), shm_dir=str(tmp_path))  # a new node
    step, state = fresh.load()  # type: ignore[misc]
    assert step == 1
    assert torch.equal(state["w"], torch.full((256,), 1.0))
    fresh.close()

    ranks[0].save(2, {"w": torch.full((256,), 40.0)}, persist=True)  # round 4's rank 0
    ranks[0].wait()
    assert storage.committed_steps(storage.open_storage(str(store))) == [1, 2]
    for ckpt in ranks:
        ckpt.close()


def test_a_storage_path_of_another_job_is_refused_naming_both(
    host: host_mod.HostHandle, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job a persists to the path first. Job b, pointed at the same path, is refused at its first persist,
    the error naming both. Job c, which resumed from a's newest step once a was over, takes the path over,
    and a, should it persist again, is refused in turn."""
    monkeypatch.delenv("PHALANX_JOB_ID", raising=False)
    monkeypatch.delenv(protocol.ENV_NAMESPACE, raising=False)
    a = Checkpointer(job_id=host.job_id, rank=0, world_size=1)
    a.save(1, {"w": torch.ones(64)}, persist=True)
    a.wait()

    others: list[host_mod.HostHandle] = []

    def job(name: str) -> Checkpointer:
        handle = host_mod.start(job_id=name, storage=str(store), socket_path=tmp_path / f"{name}.sock")
        others.append(handle)
        return Checkpointer(
            job_id=name, host_socket=str(handle.socket_path), storage=str(store), rank=0, world_size=1
        )

    try:
        b = job(f"{host.job_id}-b")
        b.save(5, {"w": torch.zeros(64)}, persist=True)
        with pytest.raises(PersistError) as refused:
            b.wait()
        assert f"job {b.job_name!r} cannot persist here" in str(refused.value)
        assert f"belongs to job {host.job_id!r}" in str(refused.value)
        assert not (store / storage.step_dir(5)).exists()

        c = job(f"{host.job_id}-c")
        assert c.load()[0] == 1  # type: ignore[index]
        assert c.resumed_from == {"job": host.job_id, "step": 1}
        c.save(2, {"w": torch.ones(64)}, persist=True)
        c.wait()
        assert storage.committed_steps(storage.open_storage(str(store))) == [1, 2]

        a.save(3, {"w": torch.ones(64)}, persist=True)
        with pytest.raises(PersistError, match=f"belongs to job {c.job_name!r}"):
            a.wait()
        for ckpt in (a, b, c):
            ckpt.close()
    finally:
        for handle in others:
            handle.stop()


def test_claim_decision() -> None:
    assert storage.claim_decision(owner=None, job="a", resumed_from=None, newest_committed=-1)[0]
    assert storage.claim_decision(owner="a", job="a", resumed_from=None, newest_committed=9)[0]
    refused, why = storage.claim_decision(owner="a", job="b", resumed_from=None, newest_committed=9)
    assert not refused
    assert "'a'" in why
    assert "'b'" in why
    resumed = {"job": "a", "step": 9}
    assert storage.claim_decision(owner="a", job="b", resumed_from=resumed, newest_committed=9)[0]
    # a went on committing after b loaded its step: a still runs, b must not take its path
    assert not storage.claim_decision(owner="a", job="b", resumed_from=resumed, newest_committed=10)[0]
    assert not storage.claim_decision(owner="z", job="b", resumed_from=resumed, newest_committed=9)[0]


def test_manifest_problem_finds_every_structural_fault() -> None:
    from phalanx.checkpoint.structure import manifest_problem

    good = {
        "size": 10,
        "crc32": 1,
        "meta": {
            "skeleton": {"T": 0},
            "tensors": [{"name": "w", "dtype": "float32", "shape": [2, 3], "offset": 0, "nbytes": 24}],
        },
    }
    assert manifest_problem(good) == ""
    assert manifest_problem([good]) != ""
    assert manifest_problem({**good, "size": "10"}) != ""
    assert manifest_problem({k: v for k, v in good.items() if k != "crc32"}) != ""
    assert manifest_problem({**good, "meta": {"tensors": []}}) != ""  # no skeleton
    tensor = good["meta"]["tensors"][0]  # type: ignore[index]
    faults = ({"shape": "2x3"}, {"dtype": "complex64"}, {"nbytes": 25}, {"offset": -1}, {"shape": [2, True]})
    for bad in faults:
        meta = {**good["meta"], "tensors": [{**tensor, **bad}]}  # type: ignore[dict-item]
        assert manifest_problem({**good, "meta": meta}) != "", bad


def test_a_foreign_claim_file_is_read_safely(tmp_path: Path) -> None:
    store = storage.open_storage(str(tmp_path))
    assert storage.read_claim(store) is None
    (tmp_path / storage.CLAIM).write_text("{trunc")
    assert storage.read_claim(store) == ""
    (tmp_path / storage.CLAIM).write_text(json.dumps({"job": "a"}))
    assert storage.read_claim(store) == "a"


def race_for_the_claim(store: storage.Storage, contenders: int = 8) -> None:
    """``contenders`` jobs claim one unclaimed root at the same moment: exactly one gets it, and every other
    is refused at once, with a message naming the winner (not at a later persist, its files mixed in)."""
    import threading

    start = threading.Barrier(contenders)
    outcome: dict[str, str] = {}

    def contend(job: str) -> None:
        start.wait()
        try:
            storage.claim(store, job=job)
            outcome[job] = "claimed"
        except storage.ForeignStorageError as exc:
            outcome[job] = str(exc)

    threads = [threading.Thread(target=contend, args=(f"job-{i}",)) for i in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [job for job, what in outcome.items() if what == "claimed"]
    assert len(outcome) == contenders
    assert len(winners) == 1, outcome
    assert storage.read_claim(store) == winners[0]
    for job, what in outcome.items():
        if job != winners[0]:
            assert repr(winners[0]) in what, what


def test_of_jobs_claiming_one_directory_at_once_exactly_one_gets_it(tmp_path: Path) -> None:
    for attempt in range(5):
        race_for_the_claim(storage.open_storage(str(tmp_path / f"root-{attempt}")))
