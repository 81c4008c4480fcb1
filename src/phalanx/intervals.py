"""The interval recorder: tells the node agent where this training process is (which step, which collective)
so that a hang is caught in seconds and blamed on the rank that caused it.

Turn it on with one call, then train as before::

    import phalanx.intervals
    phalanx.intervals.enable()                    # a plain script: steps, and collectives you wrap
    ddp = DistributedDataParallel(model)
    phalanx.intervals.register_ddp(ddp)           # DDP: every bucket all-reduce, through a comm hook
    ...
    phalanx.report_step(step)                     # records the step boundary too

    with phalanx.intervals.collective("all_reduce", group=pg):   # any other collective
        dist.all_reduce(t, group=pg)

Outside ``phalanx-run`` (no ring in the environment) :func:`enable` returns ``None`` and everything is a
no-op. Records go to a bounded ring in shared memory (:mod:`phalanx.api.intervals`): no lock, no system call.
The write path is C (``phalanx._ringwrite``, built at install where a C compiler is at hand; else the same
ring from Python, :class:`_PyWriter`): on a sub-millisecond CPU step, right after torch ops have evicted the
caches, every Python frame a record runs is a cache miss, so through C a record costs a small share of such a
step and a fraction of what it costs through Python (see docs/benchmarks.md). On a GPU a collective's end and
each step boundary are CUDA events recorded on the current stream (the start is the host's time: when the work
was queued): the training thread never synchronises; a watcher thread polls ``event.query()`` and writes the
completion time, so work that was queued on the device and never completed (a kernel or a collective that is
stuck) is told apart from a host that stopped recording anything.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import phalanx
from phalanx.api import intervals as ring

try:
    from phalanx import _ringwrite
except ImportError:  # built without a C compiler (hatch_build.py): the Python writer, the same ring
    _ringwrite = None  # type: ignore[assignment]

__all__ = ["Recorder", "begin", "collective", "enable", "end", "recorder", "register_ddp"]

_WATCH_POLL_S = 0.002  # how often the watcher asks pending CUDA events whether they completed
_IDLE_POLL_S = 0.05  # how often an idle watcher looks for the agent's request of a flight-recorder dump
FR_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch's flight-recorder size, by its name and its older one: a recorder offers dumps when either is > 0."""
DEVICE_MARK = "device_step"
"""The name of the device marker recorded at each step boundary on a GPU (an interval without group)."""


Token: TypeAlias = ring.Token
"""An interval begun and not yet ended (its record's seq in the ring): pass it to :func:`end`."""


class _PyWriter:
    """The write path in Python, where ``phalanx._ringwrite`` (the same interface in C) is not built: the
    same records in the same ring. A collective costs one dict lookup (its op and group are encoded once), a
    ``next`` on its group's sequence counter (atomic: no lock), a clock read and the ring's stores."""

    def __init__(self, writer: ring.RingWriter, mark_meta: int, encode: Callable[[str, str], int]) -> None:
        self.write = writer.write
        self.end = writer.end
        self._mark_meta = mark_meta
        self._encode = encode
        self._channels: dict[tuple[str, str], tuple[int, Iterator[int]]] = {}
        """(op, group) -> its records' meta word and its group's counter: built on first use."""
        self._counters: dict[str, Iterator[int]] = {}
        self._lock = threading.Lock()  # only to encode an (op, group) once

    def step(self, number: int) -> None:
        self.write(self._mark_meta, number, time.time_ns())

    def begin(self, op: str, group: str) -> Token:
        channel = self._channels.get((op, group)) or self._channel(op, group)
        return self.write(channel[0], next(channel[1]), time.time_ns())

    def _channel(self, op: str, group: str) -> tuple[int, Iterator[int]]:
        with self._lock:
            channel = self._channels.get((op, group))
            if channel is None:
                counter = self._counters.setdefault(group, itertools.count(1))
                channel = self._channels[(op, group)] = (self._encode(op, group), counter)
        return channel

    def end_now(self, token: Token) -> None:
        self.end(token, time.time_ns())

    def release(self) -> None:
        """Nothing to let go of: the ring writer owns the mapping."""


class Recorder:
    """Writes one process's intervals into its ring. Use :func:`enable`, not this class, in a script.

    ``native`` (default: when built) writes through ``phalanx._ringwrite``, else through :class:`_PyWriter`;
    both write the same records. Each record claims a slot of its own: no lock
    (:mod:`phalanx.api.intervals`)."""

    def __init__(self, path: Path, *, cuda: bool = False, native: bool | None = None) -> None:
        self._ring = ring.RingWriter(path)
        mark_meta = self._ring.meta(ring.MARK, False, "", "")

        def encode(op: str, group: str) -> int:
            """A collective's meta word: with the device flag on a GPU, where the watcher ends it."""
            return self._ring.meta(ring.BEGIN, cuda, op, group)

        if native is None:
            native = _ringwrite is not None
        if native and _ringwrite is None:
            raise ValueError("phalanx._ringwrite is not built (no C compiler at install)")
        self.writer: Any = (
            _ringwrite.Writer(*self._ring.hand_over(), mark_meta, encode)
            if native
            else _PyWriter(self._ring, mark_meta, encode)
        )
        """The write path: ``step``, ``begin``, ``end_now``, ``write`` and ``end``, in C or in Python."""
        self.native = native
        self.cuda = cuda
        self._pending: list[tuple[Token, Any]] = []
        self._cond = threading.Condition()
        self._watcher: threading.Thread | None = None
        self._closed = False
        self._free_events: list[Any] = []
        """Completed CUDA events, reused: creating one per record would cost a driver call each time."""
        self._device_mark = self._ring.meta(ring.BEGIN, True, DEVICE_MARK, "") if cuda else 0
        """The device marker's meta word (CUDA only)."""
        self._lookout: Any = None
        """A :class:`phalanx.flight.Lookout` the watcher asks at each tick (:meth:`look_out`), or None."""
        if not cuda and _gloo_flight_recorder():
            with self._cond:
                self._start_watcher()  # on the CPU only to answer dump requests: it sleeps 50 ms at a time

    def _record_event(self) -> Any:
        import torch

        try:
            event = self._free_events.pop()
        except IndexError:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()  # on the current stream; no synchronisation
        return event

    # ---- steps ----------------------------------------------------------------------------------------

    def step(self, step: int) -> None:
        """A step boundary: ``step`` just completed (host time). On a GPU a device marker too."""
        self.writer.step(step)
        if self._device_mark:
            self._watch(self.writer.write(self._device_mark, step, time.time_ns()), self._record_event())

    # ---- collectives ----------------------------------------------------------------------------------

    def begin(self, op: str, group: str) -> Token:
        """A collective ``op`` in ``group`` starts now (its sequence number in the group is the next)."""
        token: Token = self.writer.begin(op, group)
        return token

    def end(self, token: Token) -> None:
        """The collective ends: now on the host; on a GPU, once the device passes an event recorded now on the
        current stream (the watcher writes the end then)."""
        if self.cuda:
            self._watch(token, self._record_event())
        else:
            self.writer.end_now(token)

    def collective(self, op: str, group: str) -> _Collective:
        """``with recorder.collective("all_reduce", "dp:0,1"): ...`` records the block as one collective."""
        span = _Collective(op, group=group)
        span._rec = self
        return span

    def meta(self, op: str, group: str) -> int:
        """The meta word of collective ``op`` in ``group`` for :meth:`begin_at`."""
        return self._ring.meta(ring.BEGIN, self.cuda, op, group)

    def begin_at(self, meta: int, seq: int, unix_ns: int) -> Token:
        """A collective whose :meth:`meta` word is ``meta`` started at ``unix_ns``, numbered ``seq`` by its
        caller (c10d's own sequence, as :mod:`phalanx.instrument` and :mod:`phalanx.flight` number them)."""
        token: Token = self.writer.write(meta, seq, unix_ns)
        return token

    def look_out(self, progress: Callable[[], int]) -> bool:
        """Has the watcher read torch's flight recorder when the rank is late (:mod:`phalanx.flight`), the
        collective it waits in written as a hook would; ``progress()`` changes when the rank makes progress.
        False (and nothing done) on a GPU, whose hooks record every collective, or where torch keeps no flight
        recorder of gloo's collectives."""
        if self.cuda or not _gloo_flight_recorder():
            return False
        from phalanx import flight

        def begin(entry: flight.Entry, group: str) -> Token:
            return self.begin_at(self.meta(entry.op, group), entry.seq, entry.issued_ns)

        lookout = flight.torch_lookout(progress=progress, begin=begin, end=self.writer.end)
        if lookout is None:
            return False
        with self._cond:
            self._lookout = lookout
            if self._watcher is None:
                self._start_watcher()
        return True

    # ---- the CUDA-event watcher -----------------------------------------------------------------------

    def end_when_done(self, token: Token, work: Any) -> None:
        """The collective ends when ``work`` (a c10d ``Work``) completes: the watcher asks it every few
        milliseconds (``is_completed``) and writes the end then. Cheaper for the training thread than a
        callback on the work's future, which costs tens of microseconds a collective."""
        self._watch(token, _WorkDone(work))

    def _watch(self, token: Token, done: Any) -> None:
        with self._cond:
            self._pending.append((token, done))
            if self._watcher is None:
                self._start_watcher()
            self._cond.notify()

    def _start_watcher(self) -> None:
        """Starts the watcher thread (with ``_cond`` held); it answers the agent's dump requests when torch
        keeps a flight recorder."""
        self._watcher = threading.Thread(target=self._poll, name="phalanx-intervals", daemon=True)
        self._watcher.start()
        if any(_int_env(name) > 0 for name in FR_ENVS):
            self._ring.offer_dumps()

    def _poll(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed and not self._ring.dump_asked():
                    self._cond.wait(_IDLE_POLL_S)
                    if self._lookout is not None:
                        break  # it looks at each idle tick
                if self._closed:
                    return
                pending = list(self._pending)
            asked = self._ring.dump_asked()
            if asked:
                self._answer_dump(asked)
            if self._lookout is not None:
                self._lookout.tick(time.monotonic(), time.time_ns())
            if not pending:
                continue  # idle: the wait above paced the loop
            finished = [(t, e) for t, e in pending if e.query()]
            now = time.time_ns()
            for token, _ in finished:
                self.writer.end(token, now)
            if finished:
                with self._cond:
                    done = {id(e) for _, e in finished}
                    self._pending = [(t, e) for t, e in self._pending if id(e) not in done]
                self._free_events.extend(e for _, e in finished if not isinstance(e, _WorkDone))
            time.sleep(_WATCH_POLL_S)

    def _answer_dump(self, asked: int) -> None:
        """Writes torch's flight recorder (its own JSON dump; never pickle) for the agent: NCCL's on a GPU,
        gloo's on the CPU. From this thread: the training thread may be blocked in the very collective that
        hangs."""
        try:
            import torch

            c10d: Any = torch._C._distributed_c10d  # private API (its stubs lack the dump functions)
            if self.cuda:
                text = c10d._dump_nccl_trace_json(True, False)  # with the collectives, all entries
            else:
                text = c10d._dump_fr_trace_json(True, False, backend="gloo")
        except Exception as exc:  # no such process group yet, a torch without the recorder
            text = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        with contextlib.suppress(OSError):
            self._ring.dump_done(asked, text.encode() if isinstance(text, str) else bytes(text))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._watcher is not None:
            self._watcher.join(1.0)
        self.writer.release()  # the C writer holds the mapping, which cannot close while it does
        self._ring.close()


class _WorkDone:
    """A c10d ``Work`` as the watcher sees a CUDA event: ``query()`` says whether it completed."""

    __slots__ = ("query",)

    def __init__(self, work: Any) -> None:
        self.query = work.is_completed


_recorder: Recorder | None = None
_lock = threading.Lock()


def enable(path: str | os.PathLike[str] | None = None, *, cuda: bool | None = None) -> Recorder | None:
    """Turns the recorder on for this process and returns it; ``None`` without a ring (not under
    ``phalanx-run``). ``cuda`` (default: when torch is imported and a GPU is available) times intervals
    with CUDA events. Calling it again returns the same recorder."""
    global _recorder
    with _lock:
        if _recorder is not None:
            return _recorder
        where = path if path is not None else os.environ.get(ring.ENV_VAR)
        if not where:
            return None
        if cuda is None:
            cuda = _cuda_available()
        try:
            _recorder = Recorder(Path(where), cuda=cuda)
        except (OSError, ValueError):
            return None  # the agent went away; training must not fail because of the recorder
        # report_step calls the writer itself on the CPU: one call a step, in C where built.
        phalanx._step_recorder = _recorder if cuda else _recorder.writer
        if _ringwrite is not None:
            _ringwrite.activate(_recorder.writer, _recorder.end if cuda else None, group_of)
        return _recorder


def recorder() -> Recorder | None:
    """The recorder :func:`enable` turned on, or ``None``."""
    return _recorder


def disable() -> None:
    """Turns the recorder off (tests; a process that forks)."""
    global _recorder
    with _lock:
        if _ringwrite is not None:
            _ringwrite.activate(None, None, group_of)
        phalanx._step_recorder = None
        if _recorder is not None:
            _recorder.close()
        _recorder = None


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def _gloo_flight_recorder() -> bool:
    """Whether torch can dump a flight recorder of gloo's collectives in this process, with a buffer size set
    (as the agent sets it). torch 2.15 records them; 2.11's dump has the function but no entries."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not any(_int_env(name) > 0 for name in FR_ENVS):
        return False
    return hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")


def _cuda_available() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


_group_names: dict[tuple[int, str], tuple[weakref.ref[Any], str]] = {}
"""(id of a process group, label) -> a weak reference to the group, its group string: one dict lookup a
collective, and no new weak reference (a ``WeakKeyDictionary`` makes one per lookup). Weak: a strong reference
would keep a destroyed group alive until the interpreter's teardown, whose late destruction of gloo's threads
aborts the process; an id reused by a new group is told apart by the dead (or other) referent."""


def group_of(process_group: Any = None, label: str = "pg") -> str:
    """The group string of a torch process group (``None``: the default group), the same on every member:
    ``label:ranks``, e.g. ``dp:0,2``."""
    pg = process_group
    if pg is None:
        import torch.distributed as dist

        pg = dist.group.WORLD
    known = _group_names.get((id(pg), label))
    if known is not None and known[0]() is pg:
        return known[1]
    import torch.distributed as dist

    name = ring.group_name(label, list(dist.get_process_group_ranks(pg)))
    _group_names[(id(pg), label)] = (weakref.ref(pg), name)
    return name


def begin(op: str, *, group: Any = None, label: str = "pg") -> Token | None:
    """Records the start of a collective that completes later (an async op): pass the token to :func:`end`
    once it is waited for. None (and a no-op) when the recorder is off."""
    rec = _recorder
    if rec is None:
        return None
    return rec.begin(op, group if isinstance(group, str) else group_of(group, label))


def end(token: Token | None) -> None:
    """Records the end of a collective :func:`begin` started."""
    rec = _recorder
    if token is not None and rec is not None:
        rec.end(token)


class _Collective:
    """``with collective("all_reduce", group=pg): ...`` in Python, where ``phalanx._ringwrite.collective``
    (the same, in C) is not built. A plain class, not ``contextlib.contextmanager``, whose generator costs
    several microseconds a collective."""

    __slots__ = ("_group", "_label", "_op", "_rec", "_token")

    def __init__(self, op: str, *, group: Any = None, label: str = "pg") -> None:
        self._rec, self._op, self._group, self._label = _recorder, op, group, label

    def __enter__(self) -> Token | None:
        rec = self._rec
        if rec is None:
            return None
        group = self._group
        if group.__class__ is not str:
            group = group_of(group, self._label)
        token: Token = rec.writer.begin(self._op, group)
        self._token = token
        return token

    def __exit__(self, *exc: object) -> None:
        rec = self._rec
        if rec is not None:
            rec.end(self._token)


collective: Any = _ringwrite.collective if _ringwrite is not None else _Collective
"""``with collective("all_reduce", group=pg): ...`` records one blocking collective (``group`` a torch process
group, ``None`` for the default one, or a group string; ``label`` names a torch group's kind, ``pg`` by
default). A no-op when the recorder is off. Entering it returns the collective's token (None when off)."""


def register_ddp(ddp_model: Any, *, process_group: Any = None, label: str = "dp") -> bool:
    """Registers a DDP comm hook that all-reduces each gradient bucket as DDP does by default and records
    the all-reduce's start and its future's completion. Returns False (and registers nothing) when the
    recorder is off. Call it once, before the first backward pass (DDP allows one comm hook)."""
    rec = enable()
    if rec is None:
        return False
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    group = group_of(process_group, label)

    # No annotations: DDP refuses a hook whose ``bucket`` or return annotation is not exactly
    # dist.GradBucket / Future[Tensor], and this module's annotations are strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        token = rec.begin("all_reduce", group)
        fut = default_hooks.allreduce_hook(state, bucket)

        def done(f: Any) -> Any:
            rec.end(token)
            return f.value()

        return fut.then(done)

    ddp_model.register_comm_hook(process_group, hook)
    return True
