"""The gRPC service ``phalanx.v1.Master`` (grpc.aio): bearer-token check, validation, then the job.

Error mapping: a wrong or missing token is ``UNAUTHENTICATED``; a malformed request (empty node_id,
negative nproc, bad port, ...) or an unknown incarnation is ``INVALID_ARGUMENT``; a node that never
registered gets ``NOT_FOUND`` (it must call RegisterNode, e.g. after a master started on a fresh state);
a node that may no longer take part (evicted) gets ``FAILED_PRECONDITION``. Requests above
``max_request_bytes`` are refused by gRPC itself (``RESOURCE_EXHAUSTED``). None of these disturbs the
server.

Heartbeat may be held (``wait_s``, at most one heartbeat interval) until the job has an action for the
node: a new round reaches a held agent the moment it opens. A held heartbeat whose connection closes before
the answer marks the node disconnected (see :mod:`phalanx.master.state.nodes`). HeartbeatStream carries the
same beats on one stream per agent (the token checked once, when it opens); its closing marks the node
disconnected whether a beat is held or not.

GetRendezvous is a long-poll: while the round is still gathering, the call is held until it completes or
``min(wait_s, long_poll_max_s)`` passes, then answered WAITING. A COMPLETE answer goes out only after
the round is durable, so a master killed right after it resumes with the same round.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc import aio

from phalanx.api import auth
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.v1 import master_pb2_grpc as pb_grpc
from phalanx.master.errors import RequestError
from phalanx.master.serve.runtime import Runtime
from phalanx.master.serve.validate import validate, validate_heartbeat

__all__ = ["AuthInterceptor", "MasterService", "add_to_server"]

Resp = TypeVar("Resp")

# A held heartbeat cancelled with less time than this left before the client's deadline ran out by it.
_DEADLINE_SLACK_S = 0.1

_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
}


class AuthInterceptor(aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <the job's token>``."""

    def __init__(self, token: str) -> None:
        self._expected = auth.bearer(token).encode()

        async def deny(request: Any, context: aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token")

        # Also refuses a HeartbeatStream: a stream is checked once, when it opens (its messages never pass
        # through here), and gRPC ends it with this handler's status.
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == auth.HEADER:
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return await continuation(handler_call_details)
                break
        return self._deny


class MasterService(pb_grpc.MasterServicer):
    """Thin adapter from RPCs to :class:`~phalanx.master.job.Job` methods."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._hist = runtime.metrics.rpc_duration
        self._timers = {
            name: self._hist.labels(method=name)
            for name in (
                "RegisterNode",
                "Heartbeat",
                "HeartbeatStream",
                "JoinRendezvous",
                "GetRendezvous",
                "ReportFailure",
                "ReportCompletion",
                "ReportLogs",
                "ReportProbe",
                "ReportCheckpoint",
                "ReportStacks",
            )
        }

    async def _run(
        self,
        method: str,
        request: Any,
        context: aio.ServicerContext,
        fn: Callable[[], Resp],
        *,
        timed: bool = True,
        check: bool = True,
    ) -> Resp:
        start = time.perf_counter()
        try:
            if check:
                validate(request)
            result = fn()
        except RequestError as exc:
            self._rt.after()
            await context.abort(_CODES.get(exc.code, grpc.StatusCode.INVALID_ARGUMENT), str(exc))
            raise  # not reached: abort raises
        finally:
            if timed:
                self._timers[method].observe(time.perf_counter() - start)
        self._rt.after()
        return result

    async def _long_poll(
        self,
        method: str,
        request: Any,
        context: aio.ServicerContext,
        ask: Callable[[], Resp],
        *,
        done: Callable[[Resp], bool],
        changed: Callable[[float], Awaitable[None]],
        wait_s: float,
        checked: bool = False,
    ) -> Resp:
        """Asks the job until ``done(answer)`` or ``wait_s`` passed, asking again whenever ``changed``
        returns (it returns when the job moved, or when the time it is given ran out). The request is
        validated once (``checked``: already)."""
        deadline = time.monotonic() + wait_s
        while True:
            answer = await self._run(method, request, context, ask, timed=False, check=not checked)
            checked = True
            remaining = deadline - time.monotonic()
            if done(answer) or remaining <= 0:
                return answer
            await changed(remaining)

    async def RegisterNode(self, request: pb.RegisterNodeRequest, context: aio.ServicerContext) -> Any:
        job = self._rt.job
        return await self._run(
            "RegisterNode", request, context, lambda: job.register(request, now=self._rt.now())
        )

    async def _beat(self, method: str, request: pb.HeartbeatRequest, context: aio.ServicerContext) -> Any:
        """One heartbeat, answered at once or held (``wait_s``) until the job has an action for the node."""
        rt = self._rt
        start = time.monotonic()
        answer = await self._run(
            method,
            request,
            context,
            # Checked inside, where the job takes the ranks as the check read them (a RequestError there
            # is still answered as _run answers one).
            lambda: rt.job.heartbeat(request, ranks=validate_heartbeat(request), now=rt.now()),
            check=False,
        )
        if answer.actions or request.wait_s <= 0:
            return answer
        answer = await self._long_poll(
            method,
            request,
            context,
            lambda: rt.job.heartbeat_answer(request, now=rt.now()),
            done=lambda a: bool(a.actions),
            changed=rt.actions_changed,
            wait_s=min(request.wait_s, rt.job.settings.heartbeat.interval_s),
            checked=True,
        )
        answer.held_s = time.monotonic() - start
        return answer

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: aio.ServicerContext) -> Any:
        rt = self._rt
        try:
            return await self._beat("Heartbeat", request, context)
        except asyncio.CancelledError:
            # Cancelled before the client's deadline and not by our own shutdown: the connection closed,
            # which a SIGKILLed agent's kernel does at once.
            left = context.time_remaining()
            if not rt.stopping.is_set() and (left is None or left > _DEADLINE_SLACK_S):
                rt.job.disconnected(request, now=rt.now())
                rt.after()
            raise

    async def HeartbeatStream(self, requests: Any, context: aio.ServicerContext) -> Any:
        """Heartbeat on one stream: each beat answered in order, exactly as a Heartbeat call would be. An
        error (an unknown node, a retired one) ends the stream with that call's status code."""
        last: pb.HeartbeatRequest | None = None
        try:
            async for request in requests:
                last = request
                yield await self._beat("HeartbeatStream", request, context)
        except asyncio.CancelledError:
            self._stream_ended(last)
            raise
        self._stream_ended(last)

    def _stream_ended(self, last: pb.HeartbeatRequest | None) -> None:
        """A live agent keeps its stream open (a late answer aside, after which it opens a new one and
        beats at once): a stream that ends, cancelled or cut (gRPC ends the requests of a stream whose
        connection broke as if the agent had finished them), is the agent gone, unless it said it leaves."""
        rt = self._rt
        if last is not None and last.state != pb.NODE_STATE_LEAVING and not rt.stopping.is_set():
            rt.job.disconnected(last, now=rt.now())
            rt.after()

    async def JoinRendezvous(self, request: pb.JoinRendezvousRequest, context: aio.ServicerContext) -> Any:
        job = self._rt.job
        return await self._run(
            "JoinRendezvous", request, context, lambda: job.join(request, now=self._rt.now())
        )

    async def GetRendezvous(self, request: pb.GetRendezvousRequest, context: aio.ServicerContext) -> Any:
        rt = self._rt
        start = time.perf_counter()
        answer = await self._long_poll(
            "GetRendezvous",
            request,
            context,
            lambda: rt.job.get_rendezvous(request, now=rt.now()),
            done=lambda a: a.response.status != pb.RENDEZVOUS_STATUS_WAITING,
            changed=rt.round_changed,
            wait_s=min(request.wait_s, rt.job.settings.long_poll_max_s),
        )
        if answer.response.status == pb.RENDEZVOUS_STATUS_COMPLETE:
            await rt.wait_saved(answer.durable_version)
        self._timers["GetRendezvous"].observe(time.perf_counter() - start)
        return answer.response

    async def ReportFailure(self, request: pb.ReportFailureRequest, context: aio.ServicerContext) -> Any:
        job = self._rt.job

        def call() -> pb.ReportFailureResponse:
            return pb.ReportFailureResponse(action=job.report_failure(request, now=self._rt.now()))

        return await self._run("ReportFailure", request, context, call)

    async def ReportCompletion(
        self, request: pb.ReportCompletionRequest, context: aio.ServicerContext
    ) -> Any:
        job = self._rt.job

        def call() -> pb.ReportCompletionResponse:
            return pb.ReportCompletionResponse(action=job.report_completion(request, now=self._rt.now()))

        return await self._run("ReportCompletion", request, context, call)

    async def ReportLogs(self, request: pb.ReportLogsRequest, context: aio.ServicerContext) -> Any:
        rt = self._rt

        def call() -> pb.ReportLogsResponse:
            rt.job.check_node(request.node_id, request.incarnation)
            rt.logs.add(request.node_id, request.lines, dropped=request.dropped, now=rt.now())
            return pb.ReportLogsResponse()

        return await self._run("ReportLogs", request, context, call)

    async def ReportProbe(self, request: pb.ReportProbeRequest, context: aio.ServicerContext) -> Any:
        job = self._rt.job

        def call() -> pb.ReportProbeResponse:
            job.report_probe(request, now=self._rt.now())
            return pb.ReportProbeResponse()

        return await self._run("ReportProbe", request, context, call)

    async def ReportCheckpoint(
        self, request: pb.ReportCheckpointRequest, context: aio.ServicerContext
    ) -> Any:
        job = self._rt.job

        def call() -> pb.ReportCheckpointResponse:
            return job.report_checkpoint(request, now=self._rt.now())

        return await self._run("ReportCheckpoint", request, context, call)

    async def ReportStacks(self, request: pb.ReportStacksRequest, context: aio.ServicerContext) -> Any:
        job = self._rt.job

        def call() -> pb.ReportStacksResponse:
            job.report_stacks(request, now=self._rt.now())
            return pb.ReportStacksResponse()

        return await self._run("ReportStacks", request, context, call)


def add_to_server(server: aio.Server, runtime: Runtime) -> None:
    pb_grpc.add_MasterServicer_to_server(MasterService(runtime), server)
