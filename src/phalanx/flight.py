"""The collective a late rank waits in, read from torch's flight recorder: how ``phalanx-run`` catches an
unmodified script stuck in a collective without a Python hook on every collective.

torch records every collective of every process group in its flight recorder (in C++; ``phalanx-run`` sets
``TORCH_FR_BUFFER_SIZE``) and marks an entry retired once its work has completed. c10d's Python hooks cost
the training thread several microseconds a collective, a large share of a sub-millisecond CPU step
(docs/hangs.md, "Measured"), so :mod:`phalanx.instrument` puts them on for one step in a while only (for the
time in collectives the straggler scores need). The rest comes from here: the recorder's watcher thread asks
:class:`Lookout` at each of its ticks; when the rank has made no progress for a while (``late_after``), the
lookout reads the flight recorder and writes into the ring what a hook would have written, numbered by
c10d's own sequence as the hooks number theirs:

- the collective the rank waits in, in each group (the oldest entry not retired), as an interval open since
  it was issued: the agent judges the rank by the 10 s floor of a rank in a collective, and the master's
  suspects are the members that never entered it;
- the newest collective it entered in each group, as an interval of no length at its issue (when it
  completed is not recorded; a later time would count as activity the rank did not show).

A rank that makes progress again closes what the lookout left open. Reading the recorder costs tens of
milliseconds at a full buffer; the lookout reads it only while the rank is late, and again only when c10d's
sequence of a group moved or an interval it wrote is still open.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LATE_MIN_S = 1.0
"""A rank is late after this long without progress at least: well under the 10 s floor of a verdict, so the
interval the lookout writes is in the ring long before the agent would judge it."""
LATE_FACTOR = 1.5
"""... and after this many times the longest recent gap between progress (a job with 30 s steps reads the
recorder after 45 s without a step, not every second of every step)."""
RESCAN_S = 1.0
"""While late, the recorder is read again at most this often."""
_GAPS = 16  # recent gaps between progress the lateness is learned from
FIRST_RECORDING_TORCH = (2, 15)
"""The first torch whose flight recorder is known to hold gloo's collectives, retired once complete."""


@dataclass(frozen=True)
class Entry:
    """One collective of the flight recorder."""

    group: str
    """The process group's name in c10d (``process_group[0]`` of the dump)."""
    seq: int
    """c10d's sequence number of the collective in its group, from 1 (a hook's ``op_id + 1``)."""
    op: str
    """The collective as torch.distributed calls it (``all_reduce``)."""
    issued_ns: int
    """Wall clock, when it was issued."""
    retired: bool
    """Its work has completed."""


def parse(dump: str | bytes) -> list[Entry]:
    """The entries of torch's flight-recorder JSON dump (``_dump_fr_trace_json``); malformed ones skipped."""
    try:
        doc = json.loads(dump)
    except ValueError:
        return []
    out: list[Entry] = []
    for e in doc.get("entries", []) if isinstance(doc, dict) else []:
        try:
            out.append(
                Entry(
                    group=str(e["process_group"][0]),
                    seq=int(e["collective_seq_id"]),
                    op=str(e["profiling_name"]).rpartition(":")[2],
                    issued_ns=int(e["time_created_ns"]),
                    retired=bool(e["retired"]),
                )
            )
        except (KeyError, IndexError, TypeError, ValueError):
            continue
    return [e for e in out if e.seq > 0]


def waiting(entries: Sequence[Entry]) -> dict[str, Entry]:
    """Group -> the collective the rank waits in there: the oldest not retired (later ones queue behind)."""
    out: dict[str, Entry] = {}
    for e in entries:
        if not e.retired and (e.group not in out or e.seq < out[e.group].seq):
            out[e.group] = e
    return out


def newest(entries: Sequence[Entry]) -> dict[str, Entry]:
    """Group -> the newest collective the rank entered there."""
    out: dict[str, Entry] = {}
    for e in entries:
        if e.group not in out or e.seq > out[e.group].seq:
            out[e.group] = e
    return out


class Lookout:
    """Asked at each tick of the recorder's watcher thread (:meth:`tick`); reads the flight recorder when the
    rank is late. Its inputs are functions, so that its decisions can be driven by a test:

    ``progress()``: a number that changes when the rank makes progress (its optimizer steps);
    ``seqs()``: c10d's sequence number of each live group (cheap: no recorder read);
    ``read()``: the flight recorder's entries; ``group_of(name)``: the ring's group string of a c10d group
    name (None: the group is gone); ``begin(entry, group string)`` writes an interval begun at the entry's
    issue and returns its token, ``end(token, unix_ns)`` ends it."""

    def __init__(
        self,
        *,
        progress: Callable[[], int],
        seqs: Callable[[], Mapping[str, int]],
        read: Callable[[], list[Entry]],
        group_of: Callable[[str], str | None],
        begin: Callable[[Entry, str], int],
        end: Callable[[int, int], None],
    ) -> None:
        self._progress, self._seqs, self._read, self._group_of = progress, seqs, read, group_of
        self._begin, self._end = begin, end
        self._seen = progress()
        self._seen_at: float | None = None
        self._gaps: deque[float] = deque(maxlen=_GAPS)
        self._open: dict[tuple[str, int], int] = {}
        """(c10d group, seq) -> the token of the interval written open for it."""
        self._entered: dict[str, int] = {}
        """c10d group -> the newest seq written for it."""
        self._read_seqs: Mapping[str, int] | None = None
        self._next_read = 0.0
        self.reads = 0
        """How many times the recorder was read (for tests and benchmarks)."""

    def late_after(self) -> float:
        return max(LATE_MIN_S, LATE_FACTOR * max(self._gaps, default=0.0))

    def tick(self, now: float, now_ns: int) -> None:
        """``now``: a monotonic clock; ``now_ns``: the wall clock the ring's times are in."""
        seen = self._progress()
        if seen != self._seen or self._seen_at is None:
            if self._seen_at is not None:
                self._gaps.append(now - self._seen_at)
            self._seen, self._seen_at = seen, now
            self._close_all(now_ns)  # progress: what it waited in completed
            self._read_seqs = None
            return
        if now - self._seen_at < self.late_after() or now < self._next_read:
            return
        seqs = dict(self._seqs())
        if seqs == self._read_seqs and not self._open:
            return  # nothing issued since the last read, and nothing of ours open to close
        self._next_read = now + RESCAN_S
        self._read_seqs = seqs
        self._write(self._read(), now_ns)
        self.reads += 1

    def _write(self, entries: list[Entry], now_ns: int) -> None:
        stuck = waiting(entries)
        for key in [k for k in self._open if stuck.get(k[0]) is None or stuck[k[0]].seq != k[1]]:
            self._end(self._open.pop(key), now_ns)  # retired since, or no longer the one waited in
        for group, e in newest(entries).items():
            name = self._group_of(group)
            if name is None:
                continue
            waits = stuck.get(group)
            if e.seq > self._entered.get(group, 0) and (waits is None or waits.seq != e.seq):
                token = self._begin(e, name)  # entered: an interval of no length at its issue
                self._end(token, e.issued_ns)
            if waits is not None and (group, waits.seq) not in self._open:
                self._open[(group, waits.seq)] = self._begin(waits, name)  # written last: the current
            self._entered[group] = max(self._entered.get(group, 0), e.seq)

    def _close_all(self, now_ns: int) -> None:
        for token in self._open.values():
            self._end(token, now_ns)
        self._open.clear()


def torch_lookout(
    *,
    progress: Callable[[], int],
    begin: Callable[[Entry, str], int],
    end: Callable[[int, int], None],
    backend: str = "gloo",
) -> Lookout | None:
    """A :class:`Lookout` over this process's torch: None where torch keeps no flight recorder of gloo's
    collectives to read (before 2.15: 2.11's dump has the function but no entries; 2.14 is not verified)."""
    import torch

    c10d: Any = torch._C._distributed_c10d  # private API (its stubs lack the dump functions)
    if not hasattr(c10d, "_dump_fr_trace_json") or _release(torch.__version__) < FIRST_RECORDING_TORCH:
        return None

    def groups() -> list[tuple[str, Any]]:
        import sys

        module = sys.modules.get("torch.distributed.distributed_c10d")
        if module is None or not module.is_initialized():
            return []
        return [(name, pg) for pg, name in list(module._world.pg_names.items())]

    def seqs() -> dict[str, int]:
        out: dict[str, int] = {}
        for name, pg in groups():
            try:
                out[name] = int(pg._get_sequence_number_for_group())
            except (RuntimeError, AttributeError):
                continue  # a group whose backend keeps no sequence
        return out

    def read() -> list[Entry]:
        try:
            return parse(c10d._dump_fr_trace_json(True, False, backend=backend))
        except Exception:  # no such process group yet, a torch without the recorder
            return []

    def group_of(name: str) -> str | None:
        from phalanx import intervals

        for known, pg in groups():
            if known == name:
                return intervals.group_of(pg)
        return None

    return Lookout(progress=progress, seqs=seqs, read=read, group_of=group_of, begin=begin, end=end)


def _release(version: str) -> tuple[int, int]:
    """``"2.15.0+cu132"`` -> ``(2, 15)``; ``(0, 0)`` for a version it cannot read."""
    try:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or "0")
    except ValueError:
        return (0, 0)
