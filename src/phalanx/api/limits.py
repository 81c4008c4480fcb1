"""Size limits of what agents send the master, shared by both sides: the master refuses or cuts what is above
them (``phalanx.master.serve.validate``, ``phalanx.master.decide.failure_policy``), and the agent cuts its
reports to them before sending (``phalanx.agent.failures``), so the part that matters arrives instead of a
refusal."""

from __future__ import annotations

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""The master's default ``max_request_bytes``: gRPC refuses a larger request (RESOURCE_EXHAUSTED)."""
MIN_MAX_REQUEST_BYTES = 64 * 1024
"""The smallest ``max_request_bytes`` a master may be given."""

MAX_MESSAGE_CHARS = 4096
"""A failure's error message; also each line of its log tail. The master keeps the first characters."""
MAX_TRACEBACK_CHARS = 16384
"""A failure's traceback. The master keeps the last characters (the exception), the agent head and tail."""
MAX_TAIL_LINES = 50
"""Lines of a failure's log tail the master keeps (the last ones)."""
MAX_STACKS_CHARS = 1 << 20
"""The stack dumps of all ranks of one ReportStacks request together; the master refuses more."""
MAX_INTERVALS_PER_BEAT = 256
"""Intervals one rank's progress may carry in one heartbeat; the agent sends the newest, the master cuts."""
MAX_NAME_CHARS = 64
"""An interval's name and group; the master cuts longer ones."""
MAX_NCCL_TRACE_BYTES = 64 * 1024
"""A hung rank's NCCL flight-recorder dump in its hang evidence (``HangEvidence.nccl_trace``): the agent keeps
its first bytes (JSON cut there is marked, not parsed)."""
