"""Progress beacons: how a training process tells its agent which step it reached, through shared memory.

The agent creates one small file per worker (in ``/dev/shm``) and passes its path in
``PHALANX_BEACON_FILE``. The worker maps it and writes ``(step, unix_ns)`` under a sequence lock: the
sequence number is odd while a write is in progress, so a reader that sees an odd or changed sequence
retries. Writing costs a few hundred nanoseconds and no system call, which keeps
:func:`phalanx.report_step` cheap enough to call every step.

Layout (little endian, 32 bytes): ``u64 seq | i64 step | i64 unix_ns | u32 pid | u32 magic``.

Every field is stored and loaded as one aligned 8-byte word through a memoryview. ``struct.pack_into``
would not do: it zero-fills its target and then writes byte by byte, so a reader could see the sequence
pass through 0 (even, hence "stable") in the middle of a write, and accept a half-written step.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "PHALANX_BEACON_FILE"
MAGIC = 0x50484C58  # "PHLX"
_LAYOUT = struct.Struct("<QqqII")
SIZE = _LAYOUT.size
_SEQ, _STEP, _NS, _PID_MAGIC = range(4)  # the word index of each field


def _words(buf: mmap.mmap) -> memoryview:
    # Native 8-byte words: little endian on every platform torch ships for (x86-64, aarch64).
    return memoryview(buf).cast("q")


@dataclass(frozen=True)
class Beacon:
    """One reading of a beacon. ``step`` is -1 before the worker reported anything."""

    step: int
    unix_ns: int
    pid: int


def create(path: Path) -> None:
    """Creates (or resets) a beacon file with step -1. Called by the agent before it starts a worker."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(_LAYOUT.pack(0, -1, 0, 0, MAGIC))
    tmp.replace(path)


class BeaconWriter:
    """The worker side. Not thread-safe: one writer per beacon."""

    def __init__(self, path: Path) -> None:
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), SIZE)
        self._words = _words(self._map)
        self._seq = self._words[_SEQ] & ~1
        self._pid_magic = os.getpid() | MAGIC << 32

    def write(self, step: int) -> None:
        words = self._words
        self._seq += 1
        words[_SEQ] = self._seq  # odd: write in progress
        words[_STEP] = step
        words[_NS] = time.time_ns()
        words[_PID_MAGIC] = self._pid_magic
        self._seq += 1
        words[_SEQ] = self._seq

    def close(self) -> None:
        self._words.release()
        self._map.close()


class BeaconReader:
    """The agent side."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), SIZE, prot=mmap.PROT_READ)
        self._words = _words(self._map)

    def read(self) -> Beacon:
        # A writer that reports steps back to back can collide with many reads in a row; yielding the CPU
        # lets it finish its write. Real training reports at most every few milliseconds.
        words = self._words
        deadline = time.monotonic() + 1.0
        while True:
            seq1 = words[_SEQ]
            step, unix_ns, pid_magic = words[_STEP], words[_NS], words[_PID_MAGIC]
            seq2 = words[_SEQ]
            if seq1 == seq2 and not seq1 & 1 and pid_magic >> 32 == MAGIC:
                return Beacon(step=step, unix_ns=unix_ns, pid=pid_magic & 0xFFFFFFFF)
            if time.monotonic() > deadline:
                raise RuntimeError("beacon kept changing for a second while being read")
            os.sched_yield()

    def close(self) -> None:
        self._words.release()
        self._map.close()
