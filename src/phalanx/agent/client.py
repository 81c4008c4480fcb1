"""The agent's side of the gRPC contract: a thin client with the job token, timeouts and error mapping."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from phalanx.api import auth
from phalanx.api.errors import AuthenticationError, PhalanxError, TransportError
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.v1 import master_pb2_grpc as pb_grpc

R = TypeVar("R")

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# The master answers this when it does not know the node at all (e.g. it lost its state): register again.
# FAILED_PRECONDITION (evicted, replaced) is final and surfaces as a RetiredError.
_UNKNOWN_NODE = {grpc.StatusCode.NOT_FOUND}
TLS_CA_ENV = auth.TLS_CA_ENV
"""The agent's setting for a master that serves TLS (``--tls-cert-file``): the PEM file of the CA that signed
the master's certificate. Unset or empty: plain text."""
MAX_STRETCH = 4.0  # default deadlines of 5 s grow to at most 20 s: round trips of up to ~15 s


class MasterUnavailableError(TransportError):
    """The master did not answer (restarting, network); the call may be retried."""

    def __init__(self, message: str, *, late: bool = False) -> None:
        super().__init__(message)
        self.late = late
        """The call's deadline passed: the master or the network is slow, not known to be down."""


class UnknownNodeError(TransportError):
    """The master does not know this incarnation; the agent must register again."""


class RequestTooLargeError(TransportError):
    """The master refused the request as larger than its ``max_request_bytes`` (RESOURCE_EXHAUSTED): send it
    again cut shorter (see :func:`phalanx.agent.failures.send_fitted`)."""


class RetiredError(TransportError):
    """The master no longer lets this node take part (evicted, or replaced by a newer incarnation)."""


class UnimplementedError(TransportError):
    """The master does not serve this method (UNIMPLEMENTED): an older master, e.g. one without
    HeartbeatStream."""


def backoff_s(
    attempt: int, *, base: float = 0.2, cap: float = 5.0, rng: random.Random | None = None
) -> float:
    """Exponential backoff with full jitter between half and the whole step (never synchronised herds)."""
    step = min(cap, base * (2 ** min(attempt, 16)))
    return float(step * (0.5 + 0.5 * (rng or random).random()))


def translate(exc: grpc.RpcError) -> PhalanxError:
    """The agent's error for a failed call (see the error classes above)."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"the master refused the job token: {detail}")
    if code in _RETRYABLE:
        late = code == grpc.StatusCode.DEADLINE_EXCEEDED
        return MasterUnavailableError(f"master unavailable ({code}): {detail}", late=late)
    if code in _UNKNOWN_NODE:
        return UnknownNodeError(f"master does not know this node ({code}): {detail}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RequestTooLargeError(f"the master refused a request as too large: {detail}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return RetiredError(f"the master retired this node: {detail}")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return UnimplementedError(f"the master does not serve this call ({code}): {detail}")
    return TransportError(f"master call failed ({code}): {detail}")


_END = object()  # ends a stream's requests


class HeartbeatStream:
    """One HeartbeatStream call: :meth:`beat` sends a heartbeat and waits for its answer, with a deadline
    per beat (the stream itself has none: it lives as long as the agent's link to this master). Used by
    one thread at a time. Any error ends the stream: open a new one for the next beat."""

    def __init__(self, stub: pb_grpc.MasterStub, metadata: Any) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call = stub.HeartbeatStream(iter(self._requests.get, _END), metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True, name="phalanx-heartbeats")
        self._reader.start()
        self.closed = False

    def _read(self) -> None:
        # gRPC's sync API reads a stream only blocking, without a deadline; this thread hands each answer
        # to beat(), which waits for it with one.
        try:
            for answer in self._call:
                self._answers.put(answer)
            self._answers.put(MasterUnavailableError("the master ended the heartbeat stream"))
        except grpc.RpcError as exc:
            self._answers.put(translate(exc))

    def beat(self, req: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatResponse:
        if self.closed:
            raise MasterUnavailableError("the heartbeat stream is closed")
        self._requests.put(req)
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise MasterUnavailableError(f"no heartbeat answer within {timeout:.1f}s", late=True) from None
        if isinstance(answer, PhalanxError):
            self.close()
            raise answer
        return answer  # type: ignore[no-any-return]

    def close(self) -> None:
        """Cancels the call (the master takes it as this agent's connection closing)."""
        if not self.closed:
            self.closed = True
            self._requests.put(_END)  # frees gRPC's thread that waits for the next request
            self._call.cancel()


class MasterClient:
    """Calls the master with the job's bearer token. Thread-safe (one channel, shared)."""

    def __init__(self, *, address: str, token: str, ca_file: str | None = None) -> None:
        # Reconnect quickly to a restarted master. Not grpc.min_reconnect_backoff_ms: gRPC also takes it
        # as the time a connection attempt may take, and a link slower than that could never connect.
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
        self._channel = auth.master_channel(address, ca_file=ca_file, options=options)
        self._stub = pb_grpc.MasterStub(self._channel)
        self._metadata = auth.metadata(token)
        self._token = token
        self.stretch = 1.0
        """Multiplies the default deadlines: doubled by each call that ran out of time, halved by each that
        took under a quarter of its deadline, so an agent whose link to the master is slow (seconds each
        way) still registers and joins, where fixed deadlines would fail every attempt. Heartbeats, whose
        deadline the link derives from measured round trips, pass their own."""

    def store_key(self, purpose: str) -> str:
        """The job's secret prefix for one store (:func:`phalanx.api.auth.store_key`)."""
        return auth.store_key(self._token, purpose)

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Callable[..., Any], request: Any, timeout: float | None, *, base: float) -> Any:
        """One call; ``timeout`` None: ``base`` seconds times the client's stretch (see :attr:`stretch`)."""
        deadline = timeout if timeout is not None else base * self.stretch
        started = time.monotonic()
        try:
            answer = method(request, metadata=self._metadata, timeout=deadline)
        except grpc.RpcError as exc:
            error = translate(exc)
            if isinstance(error, MasterUnavailableError) and error.late and timeout is None:
                self.stretch = min(MAX_STRETCH, self.stretch * 2)
            raise error from exc
        if timeout is None and time.monotonic() - started < deadline / 4:
            self.stretch = max(1.0, self.stretch / 2)  # the network recovered
        return answer

    def heartbeat_stream(self) -> HeartbeatStream:
        """Opens a HeartbeatStream (nothing is sent until its first beat)."""
        return HeartbeatStream(self._stub, self._metadata)

    def register(self, req: pb.RegisterNodeRequest, timeout: float | None = None) -> pb.RegisterNodeResponse:
        return self._call(self._stub.RegisterNode, req, timeout, base=5.0)  # type: ignore[no-any-return]

    def heartbeat(self, req: pb.HeartbeatRequest, timeout: float = 2.0) -> pb.HeartbeatResponse:
        return self._call(self._stub.Heartbeat, req, timeout, base=timeout)  # type: ignore[no-any-return]

    def join(self, req: pb.JoinRendezvousRequest, timeout: float | None = None) -> pb.JoinRendezvousResponse:
        return self._call(self._stub.JoinRendezvous, req, timeout, base=5.0)  # type: ignore[no-any-return]

    def get_rendezvous(
        self, req: pb.GetRendezvousRequest, timeout: float | None = None
    ) -> pb.GetRendezvousResponse:
        return self._call(self._stub.GetRendezvous, req, timeout, base=10.0)  # type: ignore[no-any-return]

    def report_failure(
        self, req: pb.ReportFailureRequest, timeout: float | None = None
    ) -> pb.ReportFailureResponse:
        return self._call(self._stub.ReportFailure, req, timeout, base=5.0)  # type: ignore[no-any-return]

    def report_completion(
        self, req: pb.ReportCompletionRequest, timeout: float | None = None
    ) -> pb.ReportCompletionResponse:
        return self._call(self._stub.ReportCompletion, req, timeout, base=5.0)  # type: ignore[no-any-return]

    def report_logs(self, req: pb.ReportLogsRequest, timeout: float | None = None) -> pb.ReportLogsResponse:
        return self._call(self._stub.ReportLogs, req, timeout, base=2.0)  # type: ignore[no-any-return]

    def report_stacks(
        self, req: pb.ReportStacksRequest, timeout: float | None = None
    ) -> pb.ReportStacksResponse:
        return self._call(self._stub.ReportStacks, req, timeout, base=5.0)  # type: ignore[no-any-return]

    def report_probe(
        self, req: pb.ReportProbeRequest, timeout: float | None = None
    ) -> pb.ReportProbeResponse:
        return self._call(self._stub.ReportProbe, req, timeout, base=5.0)  # type: ignore[no-any-return]

    def report_checkpoint(
        self, req: pb.ReportCheckpointRequest, timeout: float | None = None
    ) -> pb.ReportCheckpointResponse:
        return self._call(self._stub.ReportCheckpoint, req, timeout, base=5.0)  # type: ignore[no-any-return]
