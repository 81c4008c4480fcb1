"""Log aggregation: worker output shipped by the agents, kept for ``/v1/logs`` and in a job log file.

Each (node, rank) has a bounded ring of the newest ``ring_lines`` lines, and a node at most
``MAX_RINGS_PER_NODE`` rings: the rank of a line is whatever the node's agent (or a script holding the job
token) sends, so the rings a node can make are bounded, not the ranks it may name. Every line is also
appended to the job log file (``<log dir>/<job id>.log``), one line per worker line::

    2026-01-02T03:04:05.678Z node-1 r3 err| the worker's text

Lines longer than ``max_line_bytes`` are cut server-side too (an agent that ignores the limit cannot
blow up the master's memory), and control characters are escaped so a worker cannot forge log lines.
File writes are buffered and flushed by the server's tick, off the request path. The file is owner-only
(0600, in directories it creates 0700): worker output may hold the job's data.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from phalanx.api import views
from phalanx.api.v1 import master_pb2 as pb

__all__ = ["LogStore", "open_private"]

_STREAMS = {pb.LOG_STREAM_STDOUT: "out", pb.LOG_STREAM_STDERR: "err"}
_CONTROL = {i: f"\\x{i:02x}" for i in range(32) if i != 9}
MAX_RINGS_PER_NODE = 256
"""More ranks than any one machine runs; a node naming more loses the rings it made first."""


def _clip(text: str, max_bytes: int) -> str:
    raw = text.encode("utf-8", "replace")
    if len(raw) > max_bytes:
        text = raw[:max_bytes].decode("utf-8", "ignore")
    return text.translate(_CONTROL)


def open_private(path: Path) -> IO[str]:
    """``path`` opened for appending, readable by its owner only: worker output may hold data or secrets
    of the job. The directories it creates are owner-only too; an existing file is made owner-only."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file left by an older version may be world-readable
        return os.fdopen(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


class LogStore:
    """Rings per (node, rank) plus the append-only job log file."""

    def __init__(self, *, ring_lines: int, max_line_bytes: int, path: Path | None) -> None:
        self.ring_lines = ring_lines
        self.max_line_bytes = max_line_bytes
        self.path = path
        self.lines_total = 0
        self.dropped_total = 0
        self._rings: dict[tuple[str, int], deque[tuple[float, int, str, str]]] = {}
        self._ranks: dict[str, deque[int]] = {}
        """Each node's ranks that have a ring, oldest first."""
        self._buffer: list[str] = []
        self._file: IO[str] | None = None

    def add(self, node_id: str, lines: Iterable[pb.LogLine], *, dropped: int, now: float) -> None:
        self.dropped_total += max(0, dropped)
        for line in lines:
            text = _clip(line.text, self.max_line_bytes)
            stream = _STREAMS.get(line.stream, "out")
            unix = line.unix_ns / 1e9 if line.unix_ns else now
            ring = self._rings.get((node_id, line.rank))
            if ring is None:
                ring = self._new_ring(node_id, line.rank)
            ring.append((unix, line.local_rank, stream, text))
            self.lines_total += 1
            if self.path is not None:
                stamp = (
                    time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix)) + f".{int(unix * 1000) % 1000:03d}Z"
                )
                self._buffer.append(f"{stamp} {node_id} r{line.rank} {stream}| {text}\n")
        if dropped > 0 and self.path is not None:
            self._buffer.append(f"[{node_id}: {dropped} lines dropped by the agent's rate limit]\n")

    def _new_ring(self, node_id: str, rank: int) -> deque[tuple[float, int, str, str]]:
        ranks = self._ranks.setdefault(node_id, deque())
        if len(ranks) >= MAX_RINGS_PER_NODE:
            del self._rings[(node_id, ranks.popleft())]
        ranks.append(rank)
        ring = self._rings[(node_id, rank)] = deque(maxlen=self.ring_lines)
        return ring

    def tail(self, *, node: str = "", rank: int | None = None, tail: int = 100) -> list[views.LogLine]:
        """The newest ``tail`` lines of the matching rings, oldest first."""
        tail = max(0, min(tail, self.ring_lines))
        picked: list[tuple[float, str, int, int, str, str]] = []
        for (node_id, r), ring in self._rings.items():
            if (node and node_id != node) or (rank is not None and r != rank):
                continue
            for unix, local_rank, stream, text in list(ring)[-tail:] if tail else []:
                picked.append((unix, node_id, r, local_rank, stream, text))
        picked.sort(key=lambda p: p[0])
        return (
            [
                views.LogLine(unix=u, node=n, rank=r, local_rank=lr, stream=s, text=t)
                for u, n, r, lr, s, t in picked[-tail:]
            ]
            if tail
            else []
        )

    def flush(self) -> None:
        """Writes buffered lines to the job log file."""
        if not self._buffer or self.path is None:
            return
        if self._file is None:
            self._file = open_private(self.path)
        self._file.writelines(self._buffer)
        self._buffer.clear()
        self._file.flush()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
