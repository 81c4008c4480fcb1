"""Interval rings: what a training process tells its agent about its steps and collectives, through shared
memory beside its progress beacon (:mod:`phalanx.api.beacon`).

The agent creates one ring file per worker (in ``/dev/shm``) and passes its path in
``PHALANX_INTERVALS_FILE``; :mod:`phalanx.intervals` in the worker appends records, the agent reads them each
monitoring tick and folds them (:class:`Tracker`) into the rank's ``RankActivity`` and the intervals it
sends the master.

A record is a step boundary (``MARK``), or the ``BEGIN`` or ``END`` of an interval: a collective (op, group,
its sequence number in the group) or a device marker (a CUDA event the process recorded at a step
boundary). There is one writing process; its threads (the training thread, a CUDA-event watcher, a
collective's completion callback) take an in-process lock, so the ring sees one writer at a time. The reader
takes no lock: every slot carries its own sequence word, ``2n+1`` while record ``n`` is being written into it
and ``2n+2`` once it is complete. A reader that sees another value before and after copying a slot has read
a torn or overwritten record and retries (or skips it, once the writer has lapped it). No pickle: fixed
little-endian words and UTF-8 strings cut to :data:`phalanx.api.limits.MAX_NAME_CHARS` bytes.

Layout: a 64-byte header of 8-byte words ``magic | capacity | head | pid | last_record_ns | dump_asked |
dump_done | dump_able`` (``head`` counts the records completely written; the last three words are the NCCL
flight-recorder dump handshake, :func:`request_dump`), then ``capacity`` slots of :data:`SLOT_WORDS` words:
``seq | kind, device, name length, group length | number | unix_ns | name (8 words) | group (8 words)``.
As in the beacon, every word is stored through an aligned 8-byte memoryview store, never ``struct.pack_into``
(which writes byte by byte).
"""

from __future__ import annotations

import functools
import mmap
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.api import limits
from phalanx.api.v1 import master_pb2 as pb

ENV_VAR = "PHALANX_INTERVALS_FILE"
MAGIC = 0x50484C5849563031  # "PHLXIV01"
DEFAULT_CAPACITY = 4096
"""Records a ring holds: at 10 records a step and 10 steps a second, four seconds of history, far more than
the agent's 0.1 s monitoring tick needs."""

MARK, BEGIN, END = 1, 2, 3
_HEADER_WORDS = 8
_H_MAGIC, _H_CAPACITY, _H_HEAD, _H_PID, _H_LAST_NS, _H_DUMP_ASKED, _H_DUMP_DONE, _H_DUMP_ABLE = range(8)
DUMP_SUFFIX = ".nccl.json"
"""The worker writes its NCCL flight-recorder dump beside its ring: ``<ring>.nccl.json``."""
_TEXT_BYTES = limits.MAX_NAME_CHARS
_TEXT_WORDS = _TEXT_BYTES // 8
SLOT_WORDS = 4 + 2 * _TEXT_WORDS
_S_SEQ, _S_META, _S_NUMBER, _S_NS = range(4)
_S_NAME = 4
_S_GROUP = 4 + _TEXT_WORDS


def size_for(capacity: int) -> int:
    return 8 * (_HEADER_WORDS + capacity * SLOT_WORDS)


@dataclass(frozen=True)
class Record:
    """One record as read from a ring. ``number`` is the step for a MARK, the sequence number for a
    collective's BEGIN/END, and the step for a device marker."""

    index: int
    kind: int
    name: str
    group: str
    number: int
    unix_ns: int
    device: bool


def create(path: Path, *, capacity: int = DEFAULT_CAPACITY) -> None:
    """Creates (or resets) an empty ring. Called by the agent before it hands a worker its round."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytearray(size_for(capacity))
    words = memoryview(header).cast("q")
    words[_H_MAGIC] = MAGIC
    words[_H_CAPACITY] = capacity
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bytes(header))
    tmp.replace(path)


def _encode(text: str) -> bytes:
    raw = text.encode("utf-8", "replace")[:_TEXT_BYTES]
    return raw.decode("utf-8", "ignore").encode()  # never cut a character in half


class _Mapped:
    def __init__(self, path: Path, *, writable: bool) -> None:
        with path.open("r+b" if writable else "rb") as f:
            total = os.fstat(f.fileno()).st_size
            if total < 8 * _HEADER_WORDS:
                raise ValueError(f"{path} is not an interval ring")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(f.fileno(), total, prot=prot)
        self._words = memoryview(self._map).cast("q")
        self._bytes = memoryview(self._map)
        if self._words[_H_MAGIC] != MAGIC:
            self.close()
            raise ValueError(f"{path} is not an interval ring")
        self.capacity = int(self._words[_H_CAPACITY])
        if size_for(self.capacity) > total or self.capacity <= 0:
            self.close()
            raise ValueError(f"{path}: ring header says {self.capacity} slots, the file is {total} bytes")

    def _slot(self, n: int) -> int:
        return _HEADER_WORDS + (n % self.capacity) * SLOT_WORDS

    def close(self) -> None:
        self._words.release()
        self._bytes.release()
        self._map.close()


class RingWriter(_Mapped):
    """The worker side. Thread-safe within one process; one process writes a ring."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, writable=True)
        self.path = str(path)
        self._lock = threading.Lock()
        self._head = int(self._words[_H_HEAD])
        self._words[_H_PID] = os.getpid()

    def append(
        self,
        kind: int,
        *,
        name: str = "",
        group: str = "",
        number: int = 0,
        device: bool = False,
        unix_ns: int | None = None,
    ) -> int:
        """Appends one record; returns its time (``time.time_ns()`` unless given)."""
        stamp = time.time_ns() if unix_ns is None else unix_ns
        meta, texts = encoded(kind, device, name, group)
        self.write(meta, texts, number, stamp)
        return stamp

    def write(self, meta: int, texts: bytes, number: int, stamp: int) -> None:
        """Appends one record already encoded by :func:`encoded`: the recorder's path, a few hundred
        nanoseconds (positional arguments, three word stores and one copy of the texts; no packing)."""
        with self._lock:
            n = self._head
            base = _HEADER_WORDS + (n % self.capacity) * SLOT_WORDS
            words = self._words
            words[base] = 2 * n + 1  # odd: being written (_S_SEQ is the slot's first word)
            words[base + _S_META] = meta
            words[base + _S_NUMBER] = number
            words[base + _S_NS] = stamp
            if texts:
                # The texts may be written byte by byte: the odd sequence word guards them.
                at = 8 * (base + _S_NAME)
                self._bytes[at : at + len(texts)] = texts
            words[base] = 2 * n + 2
            self._head = n + 1
            words[_H_LAST_NS] = stamp
            words[_H_HEAD] = n + 1

    # ---- the NCCL flight-recorder dump, answered by the recorder's CUDA watcher thread ----------------

    def offer_dumps(self) -> None:
        """Tells the agent this process answers dump requests (:func:`request_dump`)."""
        self._words[_H_DUMP_ABLE] = 1

    def dump_asked(self) -> int:
        """The pending dump request's number, 0 when none is pending."""
        asked = int(self._words[_H_DUMP_ASKED])
        return asked if asked > self._words[_H_DUMP_DONE] else 0

    def dump_done(self, asked: int, text: bytes) -> None:
        """Answers request ``asked``: writes ``text`` beside the ring (atomically), then says it is there."""
        path = Path(self.path + DUMP_SUFFIX)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(text[: limits.MAX_NCCL_TRACE_BYTES + 1])
        tmp.replace(path)
        self._words[_H_DUMP_DONE] = asked


def request_dump(path: Path, *, timeout_s: float = 1.0) -> str:
    """Asks the process writing ring ``path`` for its NCCL flight recorder and waits up to ``timeout_s`` for
    it; "" when it does not answer dumps (no CUDA recorder), or not in time (its Python is stuck holding the
    lock that the answer needs). The agent side; the answer is JSON text, never unpickled."""
    try:
        mapped = _Mapped(path, writable=True)
    except (OSError, ValueError):
        return ""
    try:
        words = mapped._words
        if not words[_H_DUMP_ABLE]:
            return ""
        asked = int(max(words[_H_DUMP_ASKED], words[_H_DUMP_DONE])) + 1
        words[_H_DUMP_ASKED] = asked
        deadline = time.monotonic() + timeout_s
        while words[_H_DUMP_DONE] < asked:
            if time.monotonic() > deadline:
                return ""
            time.sleep(0.01)
        dump = Path(str(path) + DUMP_SUFFIX)
        raw = dump.read_bytes()
        dump.unlink()  # /dev/shm is memory: nothing stays behind
    except OSError:
        return ""
    finally:
        mapped.close()
    text = raw[: limits.MAX_NCCL_TRACE_BYTES].decode("utf-8", "replace")
    return text if len(raw) <= limits.MAX_NCCL_TRACE_BYTES else text + "\n... (cut)"


@functools.lru_cache(maxsize=1024)  # a job uses a handful of names and groups: build each slot text once
def encoded(kind: int, device: bool, name: str, group: str) -> tuple[int, bytes]:
    """A record's meta word and its name and group as the slot stores them (the name padded to its field;
    nothing for a record without texts, whose slot keeps stale bytes that the lengths in meta exclude)."""
    name_b, group_b = _encode(name), _encode(group)
    meta = kind | int(device) << 8 | len(name_b) << 16 | len(group_b) << 32
    return meta, (name_b.ljust(_TEXT_BYTES, b"\0") + group_b) if name_b or group_b else b""


@dataclass(frozen=True)
class Batch:
    """What one read returned: the new records, oldest first, and how many were lost (overwritten before
    they were read)."""

    records: list[Record]
    lost: int
    last_record_ns: int
    pid: int


class RingReader(_Mapped):
    """The agent side: reads the records written since its previous read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, writable=False)
        self.cursor = 0

    def read(self, *, limit: int | None = None) -> Batch:
        words = self._words
        head = int(words[_H_HEAD])
        lost = 0
        if head - self.cursor > self.capacity:
            lost = head - self.capacity - self.cursor
            self.cursor = head - self.capacity
        if limit is not None and head - self.cursor > limit:
            head = self.cursor + limit
        records: list[Record] = []
        n = self.cursor
        while n < head:
            record = self._read_slot(n)
            if record is None:  # the writer lapped this slot while we read it
                lost += 1
            else:
                records.append(record)
            n += 1
        self.cursor = n
        last_ns, pid = int(words[_H_LAST_NS]), int(words[_H_PID])
        return Batch(records=records, lost=lost, last_record_ns=last_ns, pid=pid)

    def _read_slot(self, n: int) -> Record | None:
        base = self._slot(n)
        words = self._words
        want = 2 * n + 2
        deadline = time.monotonic() + 0.5
        while True:
            seq1 = words[base + _S_SEQ]
            meta, number, stamp = words[base + _S_META], words[base + _S_NUMBER], words[base + _S_NS]
            name_len, group_len = meta >> 16 & 0xFFFF, meta >> 32 & 0xFFFF
            at = 8 * (base + _S_NAME)
            name = bytes(self._bytes[at : at + min(name_len, _TEXT_BYTES)])
            at = 8 * (base + _S_GROUP)
            group = bytes(self._bytes[at : at + min(group_len, _TEXT_BYTES)])
            seq2 = words[base + _S_SEQ]
            if seq1 == seq2 == want:
                return Record(
                    index=n,
                    kind=meta & 0xFF,
                    name=name.decode("utf-8", "replace"),
                    group=group.decode("utf-8", "replace"),
                    number=number,
                    unix_ns=stamp,
                    device=bool(meta >> 8 & 1),
                )
            if seq1 > want or seq2 > want or time.monotonic() > deadline:
                return None  # overwritten by a later record (or a writer that died mid-record)
            os.sched_yield()  # the writer is in the middle of this very slot: let it finish


_RECENT = 64  # recent steps whose durations give the medians


@dataclass
class Tracker:
    """Folds a rank's records into its current ``RankActivity`` and the intervals not yet sent. Pure: feed
    it batches, ask it for protos."""

    entered: dict[str, int] = field(default_factory=dict)
    open: dict[tuple[str, str, int], Record] = field(default_factory=dict)
    """Intervals begun and not yet ended, by (name, group, number)."""
    last_record_ns: int = 0
    last_mark: Record | None = None
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    collective_times: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    pending: deque[pb.Interval] = field(default_factory=lambda: deque(maxlen=limits.MAX_INTERVALS_PER_BEAT))
    """Intervals to send with the next heartbeat, newest kept."""
    lost: int = 0
    _in_collectives_ns: int = 0

    @property
    def active(self) -> bool:
        """Has the rank's recorder written anything?"""
        return self.last_record_ns > 0

    def feed(self, batch: Batch) -> None:
        self.lost += batch.lost
        self.last_record_ns = max(self.last_record_ns, batch.last_record_ns)
        for r in batch.records:
            self.last_record_ns = max(self.last_record_ns, r.unix_ns)
            if r.kind == MARK:
                self._mark(r)
            elif r.kind == BEGIN:
                self.open[(r.name, r.group, r.number)] = r
                if r.group:
                    self.entered[r.group] = max(self.entered.get(r.group, 0), r.number)
            elif r.kind == END:
                began = self.open.pop((r.name, r.group, r.number), None)
                if began is not None and r.group:
                    self._in_collectives_ns += max(0, r.unix_ns - began.unix_ns)
                    self.pending.append(_interval(began, end_ns=r.unix_ns, device=r.device))

    def _mark(self, r: Record) -> None:
        prev = self.last_mark
        if prev is not None and r.number > prev.number:
            steps = r.number - prev.number
            seconds = (r.unix_ns - prev.unix_ns) / 1e9 / steps
            self.step_times.append(seconds)
            self.collective_times.append(self._in_collectives_ns / 1e9 / steps)
            self.pending.append(
                pb.Interval(name="step", seq=r.number, start_unix_ns=prev.unix_ns, end_unix_ns=r.unix_ns)
            )
        self._in_collectives_ns = 0
        self.last_mark = r

    def current(self) -> Record | None:
        """The newest collective entered and not complete."""
        collectives = [r for r in self.open.values() if r.group]
        return max(collectives, key=lambda r: r.index, default=None)

    def device_pending_since_ns(self) -> int:
        """When the oldest device work still pending was recorded; 0 when none is."""
        return min((r.unix_ns for r in self.open.values() if r.device), default=0)

    def activity(self) -> pb.RankActivity:
        act = pb.RankActivity(
            last_record_unix_ns=self.last_record_ns,
            device_pending_since_unix_ns=self.device_pending_since_ns(),
            step_time_s=statistics.median(self.step_times) if self.step_times else 0.0,
            collective_time_s=statistics.median(self.collective_times) if self.collective_times else 0.0,
        )
        cur = self.current()
        if cur is not None:
            act.current.CopyFrom(_interval(cur, end_ns=0, device=cur.device))
        for group, seq in self.entered.items():
            act.entered[group] = seq
        return act

    def take_intervals(self) -> list[pb.Interval]:
        """The intervals closed since the previous call (at most MAX_INTERVALS_PER_BEAT, the newest)."""
        out = list(self.pending)
        self.pending.clear()
        return out


def parse_group(group: str) -> tuple[str, list[int]]:
    """``"dp:0,2"`` -> ``("dp", [0, 2])``; ``"dp:0-6/2,9"`` -> ``("dp", [0, 2, 4, 6, 9])``. A group without a
    member list (or one cut short) yields the members it names."""
    label, _, members = group.partition(":")
    ranks: list[int] = []
    for part in members.replace(">", ",").split(","):  # a point-to-point channel: "pp:2>3"
        span, _, stride = part.strip().partition("/")
        first, dash, last = span.partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
            step = int(stride) if stride else 1
        except ValueError:
            continue
        ranks.extend(range(lo, hi + 1, max(1, step)))
    return label, ranks


def channel_name(src: int, dst: int, label: str = "pp") -> str:
    """The group string of the point-to-point channel from global rank ``src`` to ``dst``: ``"pp:2>3"``. Both
    ends number its sends and receives alike (messages on a channel arrive in order), and
    :func:`parse_group` reads both ranks as its members."""
    return f"{label}:{src}>{dst}"


def group_name(label: str, ranks: list[int]) -> str:
    """The group string every member computes alike: the label and the sorted global ranks, runs of equal
    stride written ``first-last/stride`` (``"dp:0-6/2"``) so that big groups fit in
    :data:`~phalanx.api.limits.MAX_NAME_CHARS`."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        if i + 1 < len(ordered):
            step = ordered[i + 1] - ordered[i]
            while j + 1 < len(ordered) and ordered[j + 1] - ordered[j] == step:
                j += 1
        if j - i >= 2:
            suffix = "" if step == 1 else f"/{step}"
            parts.append(f"{ordered[i]}-{ordered[j]}{suffix}")
            i = j + 1
        else:
            parts.append(str(ordered[i]))
            i += 1
    return f"{label}:{','.join(parts)}"


def _interval(began: Record, *, end_ns: int, device: bool) -> pb.Interval:
    """The collective ``began`` opened, ending at ``end_ns`` (0: still open)."""
    return pb.Interval(
        name=began.name,
        group=began.group,
        seq=began.number,
        start_unix_ns=began.unix_ns,
        end_unix_ns=end_ns,
        device=device,
    )
