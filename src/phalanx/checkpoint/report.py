"""Reports persisted (or failed) checkpoint shards to the job's master (torch-free).

The master counts a step as committed when every rank's shard of it was reported PERSISTED. Without a
master (plain torchrun or python) reporting is skipped and the storage commit marker is the only record.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

from phalanx.api import auth
from phalanx.api.v1 import master_pb2, master_pb2_grpc

log = logging.getLogger("phalanx.checkpoint")

MAX_QUEUED = 10_000
"""Reports kept while the master cannot be reached; past that the newest are dropped (with a warning):
the storage commit marker stays the record of what is persisted."""


class MasterReporter:
    """Sends ReportCheckpoint calls with the job's bearer token, in order, from a thread of its own.

    Persisting never waits for the master: a call to a master that is partitioned away waits out its
    10 s timeout, and on the persister's thread that held up every shard behind it (a delayed link made
    the persister fall behind the saves, and the trainer's next saves overwrote the snapshots still queued).
    """

    def __init__(self, *, addr: str, token_file: str, node_id: str, incarnation: str) -> None:
        self._token = Path(token_file).read_text().strip() if token_file else ""
        self._channel = auth.master_channel(addr)  # TLS when the agent that started the host was told a CA
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self._node_id = node_id
        self._incarnation = incarnation
        self._queue: queue.Queue[master_pb2.ReportCheckpointRequest | None] = queue.Queue(MAX_QUEUED)
        self._sender = threading.Thread(target=self._send_all, name="checkpoint-reports", daemon=True)
        self._sender.start()

    def report(
        self,
        *,
        step: int,
        ranks: list[int],
        world_size: int,
        path: str = "",
        size_bytes: int = 0,
        duration_s: float = 0.0,
        error: str = "",
    ) -> None:
        """Queues the report of one shard; it is sent in the background."""
        request = master_pb2.ReportCheckpointRequest(
            node_id=self._node_id,
            incarnation=self._incarnation,
            step=step,
            state=master_pb2.CHECKPOINT_STATE_FAILED if error else master_pb2.CHECKPOINT_STATE_PERSISTED,
            ranks=ranks,
            path=path,
            size_bytes=size_bytes,
            duration_s=duration_s,
            error=error,
            world_size=world_size,
        )
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            log.warning("%d reports wait for the master; step %d is not reported", MAX_QUEUED, step)

    def _send_all(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                self._stub.ReportCheckpoint(request, metadata=auth.metadata(self._token), timeout=10.0)
            except Exception as exc:  # a master outage must not stop persisting; the commit marker remains
                log.warning("reporting checkpoint step %d to the master failed: %s", request.step, exc)

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Sends what is queued (for at most ``timeout_s``) and closes the channel."""
        self._queue.put(None)
        self._sender.join(timeout_s)
        self._channel.close()
