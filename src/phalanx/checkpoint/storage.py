"""Storage of persisted checkpoints and the commit protocol (torch-free).

Layout under the storage root (one directory per step)::

    step-000000000042/
        rank-00000.safetensors   tensors of rank 0, written straight from shared memory
        rank-00000.json          shard manifest: the save's id, skeleton, tensor table, file size, crc32
        ...
        COMMIT.json              written once every rank's manifest of the step is present, all with
                                 the same save id
    JOB.json                     the job that writes here (see :func:`claim`)

A reader never sees a half-written file under its final name: on a POSIX path (:class:`LocalStorage`)
every file is written to a temporary name, fsynced, renamed, and the directory fsynced; in an S3 bucket
(:class:`~phalanx.checkpoint.s3.S3Storage`, ``s3://bucket/prefix``) an object appears whole or not at
all. A step without ``COMMIT.json`` is not a checkpoint. :class:`Storage` is the interface both implement.

Nothing mixed: every manifest carries the id of the save it belongs to (:func:`save_id`: the job's name
and uid, the rendezvous round, the step), and a step is committed only when every rank's id is the same,
so the shards of a step saved in two rounds (a rank that persisted step 10, died, and the next round's
ranks that reached step 10 again) never make one checkpoint. A root another job writes to is refused
(:func:`claim`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from phalanx.api.errors import PersistError
from phalanx.checkpoint.s3 import S3Storage

COMMIT = "COMMIT.json"
CLAIM = "JOB.json"
_STEP_RE = re.compile(r"^step-(\d{12})$")

# torch dtype name -> safetensors dtype code. Kept here (torch-free) because the host writes the files.
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def step_dir(step: int) -> str:
    """Relative directory of a step."""
    return f"step-{step:012d}"


def shard_file(step: int, rank: int) -> str:
    """Relative path of a rank's tensor file."""
    return f"{step_dir(step)}/rank-{rank:05d}.safetensors"


def manifest_file(step: int, rank: int) -> str:
    """Relative path of a rank's shard manifest."""
    return f"{step_dir(step)}/rank-{rank:05d}.json"


class Storage(Protocol):
    """Where persisted checkpoints live. Paths are relative, '/'-separated. Errors are OSErrors (a missing
    file: FileNotFoundError)."""

    reads: int
    """Files read so far (tests prove where a load came from)."""

    def write_atomic(self, path: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Writes a whole file so that it appears complete or not at all; returns its size."""

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Writes a small file whole only if no file has the name yet; False when one has (another writer
        was first). The one atomic test-and-set the claim of a storage root needs."""

    def read(self, path: str) -> bytes:
        """Reads a whole file."""

    def exists(self, path: str) -> bool:
        """Whether a file exists."""

    def list(self, path: str) -> list[str]:
        """Names directly under a directory ([] when it does not exist)."""

    def remove_file(self, path: str) -> None:
        """Deletes one file; a missing one is no error."""

    def remove_dir(self, path: str) -> None:
        """Deletes a directory and everything under it."""

    def url(self, path: str) -> str:
        """A location a person can find the file at."""


def _create_private(path: Path) -> int:
    """Creates ``path`` owner-only with ``O_EXCL|O_NOFOLLOW``; a leftover of a writer that died with the
    same temporary name (a pid reused in a container) is removed first, never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        path.unlink()
        return os.open(path, flags, 0o600)


class LocalStorage:
    """A directory on a POSIX file system. Counts reads so tests can prove where a load came from."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.reads = 0
        self.read_bytes = 0
        self._lock = threading.Lock()

    def _fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_atomic(self, path: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Writes to a temporary name, fsyncs, renames and fsyncs the directory. The file is owner-only
        (0600) from its creation, which never follows a symlink planted at the temporary name."""
        final = self.root / path
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        size = 0
        try:
            with os.fdopen(_create_private(tmp), "wb", buffering=0) as f:
                for chunk in chunks:
                    view = memoryview(chunk)
                    while view.nbytes:  # raw writes may be short
                        written = f.write(view)
                        if not written:
                            raise OSError(f"short write to {tmp}")
                        size += written
                        view = view[written:]
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._fsync_dir(final.parent)
        return size

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Writes the file under a temporary name and hard-links it to ``path``: link(2) fails when the
        name exists, so of two writers exactly one creates it, and the file appears whole."""
        final = self.root / path
        tmp_name = f".{final.name}.new-{os.getpid()}-{threading.get_ident()}"
        self.write_atomic(str(Path(path).with_name(tmp_name)), [data])
        tmp = final.with_name(tmp_name)
        try:
            os.link(tmp, final, follow_symlinks=False)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self._fsync_dir(final.parent)
        return True

    def read(self, path: str) -> bytes:
        """Reads a whole file and counts the read."""
        data = (self.root / path).read_bytes()
        with self._lock:
            self.reads += 1
            self.read_bytes += len(data)
        return data

    def exists(self, path: str) -> bool:
        """Whether a file exists (not counted as a read)."""
        return (self.root / path).exists()

    def list(self, path: str) -> list[str]:
        """Names directly under a directory."""
        try:
            return sorted(p.name for p in (self.root / path).iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_file(self, path: str) -> None:
        """Deletes one file, durably (its directory synced); a missing one is no error."""
        target = self.root / path
        target.unlink(missing_ok=True)
        if target.parent.exists():
            self._fsync_dir(target.parent)

    def remove_dir(self, path: str) -> None:
        """Deletes a directory tree."""
        shutil.rmtree(self.root / path, ignore_errors=True)

    def url(self, path: str) -> str:
        """The absolute path of a file."""
        return str(self.root / path)


def open_storage(location: str) -> Storage:
    """Opens the storage a location names: a directory path, a ``file://`` URL or ``s3://bucket/prefix``."""
    if location.startswith("s3://"):
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"checkpoint storage {location!r} names no bucket (s3://BUCKET/PREFIX)")
        return S3Storage(bucket, prefix)
    if "://" in location and not location.startswith("file://"):
        raise ValueError(
            f"unsupported checkpoint storage {location!r}: a directory, file:// or s3://BUCKET/PREFIX"
        )
    return LocalStorage(location.removeprefix("file://"))


def canonical_location(location: str) -> str:
    """The form of a storage location two processes can compare: an absolute directory path (relative to
    the caller's working directory), or ``s3://BUCKET/PREFIX`` without trailing slashes; "" for none."""
    if not location:
        return ""
    if location.startswith("s3://"):
        return location.rstrip("/")
    return str(Path(location.removeprefix("file://")).resolve())


def step_dirs(storage: Storage) -> list[int]:
    """Every step that has a directory, oldest first, committed or not."""
    steps = []
    for name in storage.list(""):
        match = _STEP_RE.match(name)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose commit marker exists, oldest first."""
    return [s for s in step_dirs(storage) if storage.exists(f"{step_dir(s)}/{COMMIT}")]


def shard_manifests(storage: Storage, step: int) -> list[int]:
    """Ranks whose manifest of ``step`` is on storage."""
    ranks = []
    for name in storage.list(step_dir(step)):
        match = re.match(r"^rank-(\d{5})\.json$", name)
        if match:
            ranks.append(int(match.group(1)))
    return sorted(ranks)


def committed_world_size(storage: Storage, step: int) -> int:
    """How many ranks saved the committed ``step`` (0 when its commit record cannot be read)."""
    try:
        return int(json.loads(storage.read(f"{step_dir(step)}/{COMMIT}"))["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def save_id(*, job: str, uid: str, round_no: int, step: int) -> dict[str, Any]:
    """The id of one save of one step, the same on every rank that takes part in it."""
    return {"job": job, "uid": uid, "round": round_no, "step": step}


def mixed_saves(ids: dict[int, Any]) -> str:
    """Why the shards of one step, whose manifests carry ``ids`` (rank -> save id, None for a manifest
    without one), must not be committed together; "" when they may."""
    distinct: dict[str, list[int]] = {}
    for rank, ident in sorted(ids.items()):
        distinct.setdefault(json.dumps(ident, sort_keys=True), []).append(rank)
    if len(distinct) <= 1:
        return ""
    parts = [f"ranks {ranks} saved by {key}" for key, ranks in distinct.items()]
    return "its shards come from different saves: " + "; ".join(parts)


class MixedSaveError(PersistError):
    """The shards of one step come from different saves (jobs, rounds): the step is not committed."""


def try_commit(storage: Storage, *, step: int, world_size: int) -> bool:
    """Writes the commit marker of ``step`` when every rank's manifest is present and all carry the same
    save id; returns whether the step is committed. Idempotent: several hosts may race here, each rename is
    atomic and equal. Raises :class:`MixedSaveError` when the shards come from different saves: the step
    stays uncommitted (until the ranks of one save have overwritten the others' manifests), and the
    committed steps before it are untouched."""
    if storage.exists(f"{step_dir(step)}/{COMMIT}"):
        return True
    ranks = shard_manifests(storage, step)
    if ranks != list(range(world_size)):
        return False
    ids: dict[int, Any] = {}
    for rank in ranks:
        try:
            manifest = json.loads(storage.read(manifest_file(step, rank)))
        except ValueError as exc:
            raise MixedSaveError(f"step {step}: the manifest of rank {rank} is unreadable ({exc})") from exc
        ids[rank] = manifest.get("save") if isinstance(manifest, dict) else None
    why = mixed_saves(ids)
    if why:
        raise MixedSaveError(f"step {step} was not committed: {why}")
    body: dict[str, Any] = {"step": step, "world_size": world_size, "ranks": ranks, "save": ids[0]}
    storage.write_atomic(f"{step_dir(step)}/{COMMIT}", [json.dumps(body).encode()])
    return True


def commit_record(storage: Storage, step: int) -> dict[str, Any]:
    """The commit record of ``step`` ({} when it cannot be read or is not an object)."""
    try:
        body = json.loads(storage.read(f"{step_dir(step)}/{COMMIT}"))
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


class ForeignStorageError(PersistError):
    """The storage root belongs to another job."""


def claim_decision(
    *, owner: str | None, job: str, resumed_from: dict[str, Any] | None, newest_committed: int
) -> tuple[bool, str]:
    """Whether ``job`` may write to a root claimed by ``owner`` (None: unclaimed), and why not.

    The job that claimed a root keeps it. Another job may take it over only when it continues that job:
    it resumed from that job's step there (``resumed_from``: ``{"job", "step"}``) and that job committed
    nothing newer since, so it is not running any more. A second job pointed at a running job's root is
    refused, and so is the first one once the second took over."""
    if owner is None or owner == job:
        return True, ""
    if resumed_from and resumed_from.get("job") == owner and newest_committed <= int(resumed_from["step"]):
        return True, ""
    return False, (
        f"job {job!r} cannot persist here: this checkpoint storage belongs to job {owner!r}, and two jobs "
        "writing one storage path would mix or delete each other's checkpoints; give this job its own "
        f"checkpoint path, or, when {owner!r} is over and {job!r} continues it, let {job!r} load its "
        f"checkpoint first (or remove {CLAIM} there)"
    )


def read_claim(storage: Storage) -> str | None:
    """The job that claimed the root (None when none did)."""
    try:
        body = json.loads(storage.read(CLAIM))
    except FileNotFoundError:
        return None
    except ValueError:
        return ""  # torn or foreign: claimed by nobody this job is
    return str(body.get("job", "")) if isinstance(body, dict) else ""


def claim(storage: Storage, *, job: str, uid: str = "", resumed_from: dict[str, Any] | None = None) -> None:
    """Makes sure ``job`` may write to this root, claiming it at the job's first persist; raises
    :class:`ForeignStorageError`, naming both jobs, when another job owns it (see :func:`claim_decision`).

    An unclaimed root is claimed by an exclusive create, so of two jobs claiming it at the same moment
    exactly one gets it and the other is refused at once. A takeover (the job continues the owner) replaces
    the claim and reads it back."""
    owner = read_claim(storage)
    if owner == job:
        return
    newest = max(committed_steps(storage), default=-1) if owner is not None and resumed_from else -1
    allowed, why = claim_decision(owner=owner, job=job, resumed_from=resumed_from, newest_committed=newest)
    if not allowed:
        raise ForeignStorageError(f"{storage.url('')}: {why}")
    body = json.dumps({"job": job, "uid": uid}).encode()
    if owner is None:
        storage.create_exclusive(CLAIM, body)  # lost the race: the read-back below names the winner
    else:
        storage.write_atomic(CLAIM, [body])
    now = read_claim(storage)
    if now != job:
        raise ForeignStorageError(
            f"{storage.url('')}: job {job!r} and job {now!r} claimed this checkpoint storage at the same "
            f"time; it is job {now!r}'s now: give this job its own checkpoint path"
        )


def apply_retention(storage: Storage, *, keep_last: int) -> list[int]:
    """Deletes committed steps beyond the newest ``keep_last`` and any older uncommitted leftovers.

    Steps newer than the oldest kept one are never touched: another node may still be writing them.
    """
    committed = committed_steps(storage)
    if not committed or len(committed) < keep_last:
        return []
    oldest_kept = committed[-keep_last]
    removed = [s for s in step_dirs(storage) if s < oldest_kept]
    for s in removed:
        # The marker first: a removal cut short (a crash, an S3 batch half applied) leaves an uncommitted
        # leftover, which restore skips and the next retention removes, never a "committed" step missing
        # its shards.
        storage.remove_file(f"{step_dir(s)}/{COMMIT}")
        storage.remove_dir(step_dir(s))
    return removed
