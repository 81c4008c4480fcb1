"""Storage of persisted checkpoints and the commit protocol (torch-free).

Layout under the storage root (one directory per step)::

    step-000000000042/
        rank-00000.safetensors   tensors of rank 0, written straight from shared memory
        rank-00000.json          shard manifest: skeleton, tensor table, file size and crc32
        ...
        COMMIT.json              written once every rank's manifest of the step is present

Every file is written to a temporary name, fsynced, renamed, and the directory fsynced, so a reader
never sees a half-written file under its final name. A step without ``COMMIT.json`` is not a
checkpoint. :class:`Storage` is the interface an object-store backend would implement; only
:class:`LocalStorage` (a POSIX path) exists today.
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

COMMIT = "COMMIT.json"
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
    """Where persisted checkpoints live. Paths are relative, '/'-separated."""

    def write_atomic(self, path: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Writes a whole file so that it appears complete or not at all; returns its size."""

    def read(self, path: str) -> bytes:
        """Reads a whole file."""

    def exists(self, path: str) -> bool:
        """Whether a file exists."""

    def list(self, path: str) -> list[str]:
        """Names directly under a directory ([] when it does not exist)."""

    def remove_dir(self, path: str) -> None:
        """Deletes a directory and everything under it."""

    def url(self, path: str) -> str:
        """A location a person can find the file at."""


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
        """Writes to a temporary name, fsyncs, renames and fsyncs the directory."""
        final = self.root / path
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        size = 0
        try:
            with open(tmp, "wb", buffering=0) as f:
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

    def remove_dir(self, path: str) -> None:
        """Deletes a directory tree."""
        shutil.rmtree(self.root / path, ignore_errors=True)

    def url(self, path: str) -> str:
        """The absolute path of a file."""
        return str(self.root / path)


def open_storage(location: str) -> LocalStorage:
    """Opens the storage a location string names (a directory path or ``file://`` URL)."""
    if "://" in location and not location.startswith("file://"):
        raise ValueError(f"unsupported checkpoint storage {location!r}; only local paths are implemented")
    return LocalStorage(location.removeprefix("file://"))


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


def try_commit(storage: Storage, *, step: int, world_size: int) -> bool:
    """Writes the commit marker of ``step`` when every rank's manifest is present; returns whether the
    step is committed. Idempotent: several hosts may race here, each rename is atomic and equal."""
    if storage.exists(f"{step_dir(step)}/{COMMIT}"):
        return True
    ranks = shard_manifests(storage, step)
    if ranks != list(range(world_size)):
        return False
    body: dict[str, Any] = {"step": step, "world_size": world_size, "ranks": ranks}
    storage.write_atomic(f"{step_dir(step)}/{COMMIT}", [json.dumps(body).encode()])
    return True


def apply_retention(storage: Storage, *, keep_last: int) -> list[int]:
    """Deletes committed steps beyond the newest ``keep_last`` and any older uncommitted leftovers.

    Steps newer than the oldest kept one are never touched: another node may still be writing them.
    """
    committed = committed_steps(storage)
    if len(committed) <= keep_last:
        return []
    oldest_kept = committed[-keep_last]
    removed = [s for s in step_dirs(storage) if s < oldest_kept]
    for s in removed:
        storage.remove_dir(step_dir(s))
    return removed
