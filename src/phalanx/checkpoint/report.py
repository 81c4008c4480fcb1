"""Reports persisted (or failed) checkpoint shards to the job's master (torch-free).

The master counts a step as committed when every rank's shard of it was reported PERSISTED. Without a
master (plain torchrun or python) reporting is skipped and the storage commit marker is the only record.
"""

from __future__ import annotations

import logging
from pathlib import Path

from phalanx.api import auth
from phalanx.api.v1 import master_pb2, master_pb2_grpc

log = logging.getLogger("phalanx.checkpoint")


class MasterReporter:
    """Sends ReportCheckpoint calls with the job's bearer token."""

    def __init__(self, *, addr: str, token_file: str, node_id: str, incarnation: str) -> None:
        import grpc

        self._token = Path(token_file).read_text().strip() if token_file else ""
        self._channel = grpc.insecure_channel(addr)
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self._node_id = node_id
        self._incarnation = incarnation

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
    ) -> int | None:
        """Reports one shard; returns the master's committed step, or None when the call failed."""
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
            reply = self._stub.ReportCheckpoint(request, metadata=auth.metadata(self._token), timeout=10.0)
        except Exception as exc:  # a master outage must not stop persisting; the commit marker remains
            log.warning("reporting checkpoint step %d to the master failed: %s", step, exc)
            return None
        return int(reply.committed_checkpoint_step)

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()
