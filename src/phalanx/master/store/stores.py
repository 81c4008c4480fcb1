"""Where the master keeps its durable state, and where it publishes the job status.

Two small interfaces, so the master runs the same on one machine and in Kubernetes:

* :class:`StateStore` -- the durable state (job id, round and membership, node incarnations, restart and
  eviction counts, evictions, committed checkpoint step, phase). A plain file locally
  (:class:`FileStateStore`); the ElasticJob object in Kubernetes (``phalanx.master.store.kube``). ``save`` is
  called on every durable change (coalesced by the server, never per heartbeat) and must be atomic: a
  master killed mid-write leaves the previous state readable.
* :class:`StatusSink` -- receives the ``/v1/job`` JSON on every change (coalesced to at most ~2/s). In
  Kubernetes it writes the ElasticJob status (including eviction requests the operator carries out) and
  reads back what of the spec the master follows (:class:`SpecView`); locally it is
  :class:`NullStatusSink`, since ``phalanx local`` polls ``/v1/job`` instead.

The state is a JSON object; see :meth:`phalanx.master.job.Job.durable` for its fields.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from phalanx.api import views
from phalanx.api.errors import StateStoreError

__all__ = [
    "FileStateStore",
    "MemoryStateStore",
    "NullStatusSink",
    "SpecView",
    "StateStore",
    "StatusSink",
    "write_all",
]


class StateStore(Protocol):
    """Durable storage of the master's state."""

    def load(self) -> dict[str, Any] | None: ...  # None when nothing was saved yet

    def save(self, state: Mapping[str, Any]) -> None: ...  # JSON-serializable mapping; atomic

    def holds(self) -> bool:
        """Whether this master still holds the state: False once another master took it over (this one
        must then stop: a replacement runs). Raises :class:`MasterFenced` when it can tell it was replaced
        without reading (its credentials were revoked), :class:`StateStoreError` when it cannot tell."""
        ...


class StatusSink(Protocol):
    """Receives the job status (the ``/v1/job`` view) whenever it changes."""

    def publish(self, status: views.JobView) -> None: ...  # called on every change, at most ~2/s

    def spec(self) -> SpecView | None: ...  # what the master follows of the spec (None: no spec); ~2/s


@dataclass(frozen=True)
class SpecView:
    """The part of the job's spec the master follows while it runs, and the spec's generation (the
    master publishes the generation it follows, so the operator can tell a fresh acknowledgement from a
    stale one)."""

    suspend: bool
    generation: int
    scheduled_workers: int | None = None
    """How many of the job's worker Pods the Kubernetes scheduler has placed (the operator's
    ``phalanx.dev/scheduled-workers`` annotation); None where nobody says (outside Kubernetes)."""


class FileStateStore:
    """The state as one JSON file, replaced atomically: a temporary file beside it written in full (every byte
    checked), fsync, rename, fsync of the directory. Any error on the way keeps the previous file."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateStoreError(f"cannot read the master state {self.path}: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StateStoreError(
                f"the master state {self.path} is not valid JSON; move it away to start the job afresh"
            ) from exc
        if not isinstance(data, dict):
            raise StateStoreError(f"the master state {self.path} is not a JSON object")
        return data

    def save(self, state: Mapping[str, Any]) -> None:
        """Replaces the file with ``state``, or raises :class:`StateStoreError` and leaves the previous
        file as it was: a full disk or a short write never puts a torn state in its place."""
        data = json.dumps(state, separators=(",", ":"), sort_keys=True).encode()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                write_all(fd, data)
                os.fsync(fd)  # a full disk may only show here (delayed allocation)
            finally:
                os.close(fd)
            tmp.replace(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StateStoreError(
                f"cannot write the master state {self.path} (the previous state is kept): {exc}"
            ) from exc
        try:
            # The rename is durable only once the directory entry is on disk.
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StateStoreError(f"cannot make the master state {self.path} durable: {exc}") from exc

    def holds(self) -> bool:
        return True  # one machine, one master: ``phalanx local`` never starts a second one for the file


def write_all(fd: int, data: bytes) -> None:
    """Writes every byte of ``data``: ``os.write`` may write only part of it (a disk filling up takes what
    fits and reports the rest only on the next call), so it is called until all is written; a call that
    writes nothing is a full disk."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, "no space left on device")
        view = view[written:]


class MemoryStateStore:
    """Keeps the state in memory only: for a master started without ``--state`` and for tests."""

    def __init__(self, state: Mapping[str, Any] | None = None) -> None:
        self.state: dict[str, Any] | None = json.loads(json.dumps(state)) if state is not None else None
        self.saves = 0

    def load(self) -> dict[str, Any] | None:
        return json.loads(json.dumps(self.state)) if self.state is not None else None

    def save(self, state: Mapping[str, Any]) -> None:
        self.state = json.loads(json.dumps(state))  # a deep copy that also proves it is JSON
        self.saves += 1

    def holds(self) -> bool:
        return True


class NullStatusSink:
    """Publishes nothing: locally the status is read from ``/v1/job``."""

    def publish(self, status: views.JobView) -> None:
        return None

    def spec(self) -> SpecView | None:
        return None
