"""Errors of the master's request handling; the gRPC layer maps ``code`` onto a status code."""

from __future__ import annotations

from phalanx.api.errors import PhalanxError

__all__ = ["RequestError"]


class RequestError(PhalanxError):
    """A request the master refuses: malformed, from an unknown node, or out of order.

    ``code`` is the lower-case name of the gRPC status the caller gets: ``invalid_argument`` (malformed,
    unknown incarnation), ``not_found`` (node never registered: call RegisterNode) or
    ``failed_precondition`` (valid but not now).
    """

    def __init__(self, message: str, *, code: str = "invalid_argument") -> None:
        super().__init__(message)
        self.code = code
