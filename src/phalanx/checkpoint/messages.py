"""The checkpoint host's requests and replies, typed (torch-free).

On the wire each is one JSON object (see :mod:`phalanx.checkpoint.protocol`): a request names its kind in
``op``; a reply carries ``ok`` and, when it is false, ``error``. :func:`parse_request` is the boundary on
the host's side: a line that is not one of the requests below, with the fields it needs of the types it
needs, raises :class:`MalformedMessage`, which the host answers with an error (never a crash). Clients send
``to_dict()`` of a request and read replies through the ``from_dict`` of the reply they expect.

Requests and their replies::

    Alloc(rank, size)          -> Allocated(paths)              the rank's two slots, created and sized
    Persist(rank, step|None)   -> Reply()                       queued (and the step's slot pinned)
    Wait(rank, step|None, timeout|None)
                               -> Waited(ok, error, results)    the rank's persists so far
    PersistNow()               -> PersistedNow(ok, steps, errors)
    Ping()                     -> Pong(pid, storage)
    Stop()                     -> Reply()

Any of them may be answered with ``Reply(ok=False, error=...)`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

Message = dict[str, Any]
"""One JSON object as it crosses the socket."""


class MalformedMessage(ValueError):
    """A message that is not what the protocol allows; its text says what is wrong."""


# ---------------------------------------------------------------------------------------------------
# Field checks: what a JSON object must hold (bool is an int in Python, never in this protocol)


def _count(message: Message, key: str) -> int:
    value = message.get(key)
    if type(value) is not int or value < 0:
        raise MalformedMessage(f"{key!r} must be a non-negative integer, not {value!r}")
    return value


def _optional_count(message: Message, key: str) -> int | None:
    return None if message.get(key) is None else _count(message, key)


def _optional_seconds(message: Message, key: str) -> float | None:
    value = message.get(key)
    if value is None:
        return None
    if type(value) not in (int, float):
        raise MalformedMessage(f"{key!r} must be a number of seconds or null, not {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class Alloc:
    """Create (or grow) the two slots of ``rank``, ``size`` bytes each."""

    OP: ClassVar[str] = "alloc"
    rank: int
    size: int

    @classmethod
    def from_dict(cls, message: Message) -> Alloc:
        return cls(rank=_count(message, "rank"), size=_count(message, "size"))

    def to_dict(self) -> Message:
        return {"op": self.OP, "rank": self.rank, "size": self.size}


@dataclass(frozen=True)
class Persist:
    """Persist ``rank``'s snapshot of ``step`` (None: its newest) in the background."""

    OP: ClassVar[str] = "persist"
    rank: int
    step: int | None = None

    @classmethod
    def from_dict(cls, message: Message) -> Persist:
        return cls(rank=_count(message, "rank"), step=_optional_count(message, "step"))

    def to_dict(self) -> Message:
        return {"op": self.OP, "rank": self.rank, "step": self.step}


@dataclass(frozen=True)
class Wait:
    """Wait (at most ``timeout`` seconds, None: as long as it takes) for ``rank``'s queued persists; the
    results of ``step`` only, or of all when None."""

    OP: ClassVar[str] = "wait"
    rank: int
    step: int | None = None
    timeout: float | None = None

    @classmethod
    def from_dict(cls, message: Message) -> Wait:
        return cls(
            rank=_count(message, "rank"),
            step=_optional_count(message, "step"),
            timeout=_optional_seconds(message, "timeout"),
        )

    def to_dict(self) -> Message:
        return {"op": self.OP, "rank": self.rank, "step": self.step, "timeout": self.timeout}


@dataclass(frozen=True)
class PersistNow:
    """Persist every rank's newest complete snapshot, and wait for it (the agent's save at failure)."""

    OP: ClassVar[str] = "persist_now"

    @classmethod
    def from_dict(cls, message: Message) -> PersistNow:
        return cls()

    def to_dict(self) -> Message:
        return {"op": self.OP}


@dataclass(frozen=True)
class Ping:
    """Who is the host (its pid) and where does it persist."""

    OP: ClassVar[str] = "ping"

    @classmethod
    def from_dict(cls, message: Message) -> Ping:
        return cls()

    def to_dict(self) -> Message:
        return {"op": self.OP}


@dataclass(frozen=True)
class Stop:
    """Drain persistence, release the job's memory and exit."""

    OP: ClassVar[str] = "stop"

    @classmethod
    def from_dict(cls, message: Message) -> Stop:
        return cls()

    def to_dict(self) -> Message:
        return {"op": self.OP}


Request = Alloc | Persist | Wait | PersistNow | Ping | Stop

REQUESTS: dict[str, type[Request]] = {
    kind.OP: kind for kind in (Alloc, Persist, Wait, PersistNow, Ping, Stop)
}
"""Each request kind by the ``op`` that names it on the wire."""


def parse_request(message: Any) -> Request:
    """The request a decoded JSON line holds; :class:`MalformedMessage` saying why when it holds none."""
    if not isinstance(message, dict):
        raise MalformedMessage("a request must be a JSON object")
    op = message.get("op")
    kind = REQUESTS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise MalformedMessage(f"unknown request {op!r}")
    return kind.from_dict(message)


# ---------------------------------------------------------------------------------------------------
# Replies


@dataclass(frozen=True)
class Reply:
    """A plain answer: done, or refused with why."""

    ok: bool = True
    error: str = ""

    @classmethod
    def failed(cls, error: str) -> Reply:
        return cls(ok=False, error=error)

    @classmethod
    def from_dict(cls, message: Message) -> Reply:
        return cls(ok=bool(message.get("ok")), error=str(message.get("error") or ""))

    def to_dict(self) -> Message:
        return {"ok": True} if self.ok else {"ok": False, "error": self.error}


@dataclass(frozen=True)
class Allocated:
    """The paths of the rank's two slots."""

    paths: list[str]

    @classmethod
    def from_dict(cls, message: Message) -> Allocated:
        paths = message.get("paths")
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise MalformedMessage(f"an allocation reply must list the slot paths, not {paths!r}")
        return cls(paths=paths)

    def to_dict(self) -> Message:
        return {"ok": True, "paths": list(self.paths)}


@dataclass(frozen=True)
class Waited:
    """What became of a rank's persists: one result per persist (``step``, and ``path``/``committed`` or
    ``error`` or ``skipped``); ``ok`` is false when one failed or the wait timed out."""

    ok: bool
    error: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, message: Message) -> Waited:
        results = message.get("results", [])
        return cls(
            ok=bool(message.get("ok")),
            error=str(message.get("error") or ""),
            results=results if isinstance(results, list) else [],
        )

    def to_dict(self) -> Message:
        return {"ok": self.ok, "error": self.error, "results": self.results}


@dataclass(frozen=True)
class PersistedNow:
    """The step persisted for each rank (by rank as a string: a JSON key) and what failed."""

    ok: bool
    steps: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> Message:
        return {"ok": self.ok, "steps": self.steps, "errors": self.errors}


@dataclass(frozen=True)
class Pong:
    """The host's pid, and where it persists (canonical; "" for nowhere)."""

    pid: int
    storage: str

    @classmethod
    def from_dict(cls, message: Message) -> Pong:
        pid, storage = message.get("pid", 0), message.get("storage", "")
        if type(pid) is not int or not isinstance(storage, str):
            raise MalformedMessage(f"a ping reply must give a pid and a storage location, not {message!r}")
        return cls(pid=pid, storage=storage)

    def to_dict(self) -> Message:
        return {"ok": True, "pid": self.pid, "storage": self.storage}


AnyReply = Reply | Allocated | Waited | PersistedNow | Pong
