"""Interval rings: what a training process tells its agent about its steps and collectives, through shared
memory beside its progress beacon (:mod:`phalanx.api.beacon`).

The agent creates one ring file per worker (in ``/dev/shm``) and passes its path in
``PHALANX_INTERVALS_FILE``; :mod:`phalanx.intervals` in the worker writes records, the agent reads them each
monitoring tick and folds them (:class:`Tracker`) into the rank's ``RankActivity`` and the intervals it
sends the master.

A record is a step boundary (``MARK``) or an interval (``BEGIN``): a collective (op, group, its sequence
number in the group) or a device marker (a CUDA event the process recorded at a step boundary). Writing
records is the recorder's cost on the training path, paid several times a step, so it is kept to a few
word stores, with no lock, no allocation beyond a token and no system call. :class:`RingWriter` is the
reference writer, in Python; the recorder writes through ``phalanx._ringwrite`` where it was built, which
makes the same stores in C (``tests/agent/test_ring_writers.py`` checks both write the same words):

- **Fixed-size slots, one array per field**: ``seq``, ``meta``, ``number``, ``unix_ns``, ``end_ns``, each an
  array of ``capacity`` words, record ``n`` at index ``(n + 1) % capacity`` of each (a power of two: no
  slot arithmetic beyond a mask on the write path). An interval is one slot: its start writes the slot,
  its end one word of it (``end_ns``, 0 while open); the reader turns a slot whose end is set into a
  ``BEGIN`` and an ``END`` record.
- **A text table.** The op and group names are not copied into each record: each distinct string is
  written once into the ring's text table, and records carry its index in ``meta``
  (``kind | device << 8 | name index << 16 | group index << 32``).
- **No lock.** One process writes a ring, from several threads (the training thread, the CUDA-event
  watcher, a collective's completion callback): each record claims its index with the GIL held (``next``
  on an ``itertools.count`` here, a counter in C), so two threads never share a slot.
- **Per-slot sequence words.** Record ``n``'s ``seq`` is ``-(n+1)`` while it is being written and ``n+1``
  once complete. The reader takes no lock and there is no shared head: it reads slots in order for as
  long as they hold complete records (a smaller magnitude: not written yet; negative: being written; a
  larger one: the writer has lapped the reader, which skips what was overwritten), copying a slot and
  checking its ``seq`` again after; it re-reads the ``end_ns`` of the intervals it saw open until they
  close. An interval's end is stored only if its slot still holds it.

No pickle: fixed little-endian words and UTF-8 strings cut to :data:`phalanx.api.limits.MAX_NAME_CHARS`
bytes. As in the beacon, every word is stored through an aligned 8-byte memoryview store, never
``struct.pack_into`` (which zero-fills its target first, then writes byte by byte).

Layout: a 128-byte header of 8-byte words ``magic | capacity | pid | text_capacity | texts | dump_asked |
dump_done | dump_able`` (``texts`` counts the text-table entries written; the ``dump`` words are the NCCL
flight-recorder dump handshake, :func:`request_dump`), then the :data:`SLOT_WORDS` field arrays of
``capacity`` words, then ``text_capacity`` text entries of ``length | UTF-8 bytes (8 words)``; text index
``i`` is entry ``i - 1``, index 0 the empty string.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from phalanx.api import limits

ENV_VAR = "PHALANX_INTERVALS_FILE"
INSTRUMENT_ENV_VAR = "PHALANX_HANG_INSTRUMENT"
"""``0``: the worker's bootstrap leaves the script uninstrumented (``phalanx.instrument``); the agent's own
setting of that name (``hang.instrument``) sets it for its workers."""
MAGIC = 0x50484C5849563032  # "PHLXIV02": 5-word slots whose intervals end in place, and a text table
DEFAULT_CAPACITY = 4096
"""Records a ring holds: at 10 records a step and 10 steps a second, four seconds of history, far more than
the agent's 0.1 s monitoring tick needs."""
DEFAULT_TEXTS = 1024
"""Distinct op and group names a ring holds: a job uses a few dozen (ops x its groups and channels)."""

MARK, BEGIN, END = 1, 2, 3
_HEADER_WORDS = 16
_H_MAGIC, _H_CAPACITY, _H_PID, _H_TEXT_CAPACITY, _H_TEXTS = range(5)
_H_DUMP_ASKED, _H_DUMP_DONE, _H_DUMP_ABLE = range(5, 8)
DUMP_SUFFIX = ".nccl.json"
"""The worker writes its NCCL flight-recorder dump beside its ring: ``<ring>.nccl.json``."""
SLOT_WORDS = 5
"""Words a record takes: one in each field array (seq, meta, number, unix_ns, end_ns)."""
_TEXT_BYTES = limits.MAX_NAME_CHARS
_TEXT_WORDS = 1 + _TEXT_BYTES // 8  # length, then the bytes
TEXT_FULL = 0xFFFF
"""The text index of a name written once the table was full: read as :data:`FULL_TEXT`."""
FULL_TEXT = "?"
_STUCK_S = 0.5
"""How long the reader waits for a record that a later one overtook (its writer was preempted, or died,
between claiming it and completing it) before it counts it lost and reads on."""


def size_for(capacity: int, texts: int = DEFAULT_TEXTS) -> int:
    return 8 * (_HEADER_WORDS + capacity * SLOT_WORDS + texts * _TEXT_WORDS)


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


def create(path: Path, *, capacity: int = DEFAULT_CAPACITY, texts: int = DEFAULT_TEXTS) -> None:
    """Creates (or resets) an empty ring. Called by the agent before it hands a worker its round."""
    if capacity <= 0 or capacity & (capacity - 1):
        raise ValueError(f"a ring's capacity is a power of two, not {capacity}")
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytearray(size_for(capacity, texts))
    words = memoryview(header).cast("q")
    words[_H_MAGIC] = MAGIC
    words[_H_CAPACITY] = capacity
    words[_H_TEXT_CAPACITY] = min(texts, TEXT_FULL - 1)
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
        self._fields: list[memoryview] = []
        if self._words[_H_MAGIC] != MAGIC:
            self.close()
            raise ValueError(f"{path} is not an interval ring")
        cap = self.capacity = int(self._words[_H_CAPACITY])
        self.text_capacity = int(self._words[_H_TEXT_CAPACITY])
        if cap <= 0 or cap & (cap - 1) or size_for(cap, self.text_capacity) > total:
            self.close()
            raise ValueError(f"{path}: ring header says {cap} slots, the file is {total} bytes")
        self._mask = cap - 1
        starts = [_HEADER_WORDS + k * cap for k in range(SLOT_WORDS)]
        self.field_offsets = tuple(starts)
        """Where each field array starts, in words: seq, meta, number, unix_ns, end_ns."""
        self._fields = [self._words[start : start + cap] for start in starts]
        self._seqs, self._metas, self._numbers, self._stamps, self._ends = self._fields
        self._texts_base = _HEADER_WORDS + cap * SLOT_WORDS

    def close(self) -> None:
        for view in self._fields:
            view.release()
        self._words.release()
        self._bytes.release()
        self._map.close()


Token: TypeAlias = int
"""A record written: its complete ``seq`` (its slot: ``seq & mask``); :meth:`RingWriter.end` ends an
interval with it."""


class RingWriter(_Mapped):
    """The worker side. Thread-safe within one process, without a lock; one process writes a ring."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, writable=True)
        self.path = str(path)
        self._claim = itertools.count(1 + max(abs(int(seq)) for seq in self._seqs))
        """The next record's ``seq`` (its index + 1; a writer attaching to a ring already written goes on
        after its newest record): ``next`` is one atomic C call, so each thread gets slots of its own."""
        self._text_ids: dict[str, int] = {"": 0}
        self._texts_lock = threading.Lock()  # only to add a string to the text table, once per string
        self._words[_H_PID] = os.getpid()

    def meta(self, kind: int, device: bool, name: str, group: str) -> int:
        """A record's meta word (its texts written into the table the first time): encode it once per
        (kind, op, group), then :meth:`write` as often as needed."""
        return kind | int(device) << 8 | self.text_id(name) << 16 | self.text_id(group) << 32

    def text_id(self, text: str) -> int:
        """The index of ``text`` in the ring's text table, written there on first use."""
        tid = self._text_ids.get(text)
        if tid is not None:
            return tid
        with self._texts_lock:
            tid = self._text_ids.get(text)
            if tid is None:
                words = self._words
                count = int(words[_H_TEXTS])
                if count >= self.text_capacity:
                    tid = TEXT_FULL
                else:
                    raw = _encode(text)
                    base = self._texts_base + count * _TEXT_WORDS
                    self._bytes[8 * (base + 1) : 8 * (base + 1) + len(raw)] = raw
                    words[base] = len(raw)
                    words[_H_TEXTS] = count + 1  # published after the entry: readers see it whole
                    tid = count + 1
                self._text_ids[text] = tid
        return tid

    def append(
        self,
        kind: int,
        *,
        name: str = "",
        group: str = "",
        number: int = 0,
        device: bool = False,
        unix_ns: int | None = None,
    ) -> Token:
        """Writes one record (``MARK`` or ``BEGIN``; an interval ends with :meth:`end`) at ``unix_ns``
        (default now) and returns its token."""
        if kind not in (MARK, BEGIN):
            raise ValueError(f"record kind {kind}: write a MARK or a BEGIN, and end a BEGIN with end()")
        stamp = time.time_ns() if unix_ns is None else unix_ns
        return self.write(self.meta(kind, device, name, group), number, stamp)

    def write(self, meta: int, number: int, stamp: int) -> Token:
        """Writes one record whose meta word :meth:`meta` encoded, and returns its token (for :meth:`end`):
        the Python path: one claim, a mask and six word stores (``phalanx._ringwrite`` makes the same stores
        in C)."""
        seq = next(self._claim)
        i = seq & self._mask
        seqs = self._seqs
        seqs[i] = -seq  # being written
        self._metas[i] = meta
        self._numbers[i] = number
        self._stamps[i] = stamp
        self._ends[i] = 0  # open (unused by a MARK)
        seqs[i] = seq
        return seq

    def end(self, token: Token, stamp: int) -> None:
        """Ends the interval ``token`` names at ``stamp``: one word, stored only if the slot still holds the
        interval (a writer that lapped the ring meanwhile has made it another record's)."""
        i = token & self._mask
        if self._seqs[i] == token:
            self._ends[i] = stamp

    def hand_over(self) -> tuple[mmap.mmap, tuple[int, ...], int, int]:
        """Hands the write path to another writer of this process (``phalanx._ringwrite``, the recorder's
        write path in C): the mapping, :attr:`field_offsets`, the capacity, and the ``seq`` its first record
        takes. This writer writes no records after (its text table is still the one to use)."""
        return self._map, self.field_offsets, self.capacity, next(self._claim)

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


@dataclass(frozen=True)
class Batch:
    """What one read returned: the new records, oldest first, how many were lost (overwritten before they
    were read), and the newest record's time (0 when none is new)."""

    records: list[Record]
    lost: int
    last_record_ns: int
    pid: int


_NOT_YET = -1


class RingReader(_Mapped):
    """The agent side: reads the records written since its previous read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, writable=False)
        self.cursor = 0
        self._texts: list[str] = [""]
        """The text table as read so far (entries are written once and never change)."""
        self._open: dict[int, Record] = {}
        """Intervals read while open, by record index: their ``end_ns`` is read again each time."""
        self._stuck: tuple[int, float] | None = None
        """A record a later one overtook, and when the reader first waited for it."""

    def read(self, *, limit: int | None = None) -> Batch:
        """The records written since the previous read (at most ``limit`` slots), an interval's ``END``
        after its ``BEGIN`` once its end is set, all in time order."""
        out: list[Record] = []
        lost = 0
        n = self.cursor
        budget = limit if limit is not None else self.capacity
        for _ in range(2 * budget):  # at most ``budget`` slots read, and as many skips after a lapping writer
            if n - self.cursor - lost >= budget:
                break
            got = self._read_slot(n)
            if isinstance(got, Record):
                out.append(got)
                if got.kind == BEGIN:
                    self._open[n] = got  # _ended() below emits its END once its end is set
            elif got > n:  # the writer lapped the reader: records up to ``got - capacity`` were overwritten
                skip_to = got - self.capacity + 1
                lost += skip_to - n
                n = skip_to
                continue
            elif self._overtaken(n) and self._waited_too_long(n):
                lost += 1  # claimed and never completed (its writer died, or an exception cut it short)
            else:
                break  # not written yet, or still being written: read it next time
            n += 1
        self.cursor = n
        out.extend(self._ended())
        out.sort(key=_time_order)
        last_ns = max((r.unix_ns for r in out), default=0)
        return Batch(records=out, lost=lost, last_record_ns=last_ns, pid=int(self._words[_H_PID]))

    def _ended(self) -> list[Record]:
        """The END records of the open intervals whose end is now set; forgets those overwritten."""
        ended: list[Record] = []
        for n, began in list(self._open.items()):
            i = (n + 1) & self._mask
            end_ns = self._ends[i]
            if self._seqs[i] != n + 1:
                del self._open[n]  # lapped while open: its end is lost with it
            elif end_ns:
                del self._open[n]
                ended.append(Record(n, END, began.name, began.group, began.number, int(end_ns), began.device))
        return ended

    def _overtaken(self, n: int) -> bool:
        """Is the record after ``n`` complete while ``n`` is not (two threads finished out of order, or the
        writer of ``n`` died or raised between claiming and completing it)? One slot is looked at: this
        runs at every read that reaches the newest record."""
        return isinstance(self._read_slot(n + 1), Record)

    def _waited_too_long(self, n: int) -> bool:
        now = time.monotonic()
        if self._stuck is None or self._stuck[0] != n:
            self._stuck = (n, now)
            return False
        return now - self._stuck[1] > _STUCK_S

    def _read_slot(self, n: int) -> Record | int:
        """Record ``n``; else the index of the record its slot holds or is writing when that is later (the
        writer lapped the reader), else :data:`_NOT_YET`."""
        i = (n + 1) & self._mask
        want = n + 1
        seq1 = self._seqs[i]
        meta, number, stamp = self._metas[i], self._numbers[i], self._stamps[i]
        seq2 = self._seqs[i]
        if seq1 == seq2 == want:
            kind = meta & 0xFF
            began = Record(
                index=n,
                kind=kind,
                name=self._text(meta >> 16 & 0xFFFF),
                group=self._text(meta >> 32 & 0xFFFF),
                number=number,
                unix_ns=stamp,
                device=bool(meta >> 8 & 1),
            )
            return began
        newest = max(abs(seq1), abs(seq2))
        return newest - 1 if newest > want else _NOT_YET

    def _text(self, tid: int) -> str:
        if tid < len(self._texts):
            return self._texts[tid]
        if tid == TEXT_FULL:
            return FULL_TEXT
        words = self._words
        count = min(int(words[_H_TEXTS]), self.text_capacity)
        for i in range(len(self._texts) - 1, count):  # entry i is text index i + 1
            base = self._texts_base + i * _TEXT_WORDS
            length = min(int(words[base]), _TEXT_BYTES)
            raw = bytes(self._bytes[8 * (base + 1) : 8 * (base + 1) + length])
            self._texts.append(raw.decode("utf-8", "replace"))
        return self._texts[tid] if tid < len(self._texts) else ""


def _time_order(r: Record) -> tuple[int, int, int]:
    """Records by time; at a tie, by index, an END after the BEGIN of its own slot."""
    return (r.unix_ns, r.index, r.kind == END)


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
