"""A reverse proxy in front of the real API server that injects the faults a watch meets in a cluster: a
LIST that is slow to answer, a watch that stalls without its connection closing, and ``410 Gone`` (the
resourceVersion a watch resumes from has expired, so the client must LIST again).

It speaks plain HTTP to the client (the operator's kubeconfig points at it, with its own token, which is
passed on as is) and HTTPS to the API server; everything else is passed through unchanged, streamed. It runs
in its own thread and event loop. A kind is the last part of a request's path (``pods``, ``elasticjobs``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

PASSED_HEADERS = ("authorization", "accept", "content-type", "user-agent")
GONE = {
    "type": "ERROR",
    "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 410,
        "reason": "Expired", "message": "too old resource version (the test's proxy)",
    },
}  # fmt: skip


@dataclass(frozen=True)
class Request:
    at: float
    """time.monotonic() when it came in."""
    method: str
    kind: str
    watch: bool
    path: str


@dataclass
class Faults:
    slow_lists: dict[str, float] = field(default_factory=dict)
    """kind -> seconds a LIST's answer is held back."""
    stalled_since: dict[str, float] = field(default_factory=dict)
    """kind -> when its watches stalled: a watch opened before then forwards nothing more."""
    gone: set[str] = field(default_factory=set)
    """kinds whose next watch is answered 410 Gone."""


class ApiProxy:
    def __init__(self, upstream: str, ca: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=str(ca))
        self.faults = Faults()
        self.requests: list[Request] = []
        self.listed: list[tuple[str, float]] = []
        """(kind, when) of every LIST answered."""
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="api-proxy", daemon=True)

    @property
    def server(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ApiProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the API proxy did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._closing.set)
        time.sleep(0.2)  # the held watches end
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def stall(self, kind: str) -> float:
        """Stalls every watch of ``kind`` open now (later ones pass); returns when."""
        now = time.monotonic()
        self.faults.stalled_since[kind] = now
        return now

    def lists(self, kind: str) -> list[float]:
        """When each LIST of ``kind`` was answered."""
        return [at for k, at in list(self.listed) if k == kind]

    def watches(self, kind: str, since: float = 0.0) -> list[Request]:
        return [r for r in list(self.requests) if r.kind == kind and r.watch and r.at >= since]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = self._loop.run_until_complete(self._open())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._session.close())
            self._loop.run_until_complete(runner.cleanup())
            self._loop.close()

    async def _open(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._closing = asyncio.Event()
        self._session = ClientSession(timeout=ClientTimeout(total=None), auto_decompress=False)
        return runner

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        kind = request.path.rstrip("/").rsplit("/", 1)[-1]
        watch = request.query.get("watch") in ("true", "1")
        opened = time.monotonic()
        self.requests.append(Request(opened, request.method, kind, watch, request.path_qs))
        if watch and kind in self.faults.gone:
            self.faults.gone.discard(kind)
            gone = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await gone.prepare(request)
            await gone.write(json.dumps(GONE).encode() + b"\n")
            await gone.write_eof()
            return gone
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        headers["Accept-Encoding"] = "identity"  # passed on as it comes, never compressed
        body = await request.read()
        # A body sent without a type (the Kubernetes client's) goes on without one: aiohttp would call it
        # application/octet-stream, which the API server refuses.
        untyped = () if "Content-Type" in request.headers else ("Content-Type",)
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body or None,
            ssl=self._ssl, skip_auto_headers=untyped,
        ) as upstream:  # fmt: skip
            listing = request.method == "GET" and not watch
            if listing and kind in self.faults.slow_lists:
                await asyncio.sleep(self.faults.slow_lists[kind])
            answer = web.StreamResponse(
                status=upstream.status,
                headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")},
            )
            await answer.prepare(request)
            async for chunk in upstream.content.iter_any():
                if watch and self._stalled(kind, opened):
                    await self._closing.wait()  # held: the client sees a connection that says nothing
                    break
                await answer.write(chunk)
            if listing:
                self.listed.append((kind, time.monotonic()))
            await answer.write_eof()
            return answer

    def _stalled(self, kind: str, opened: float) -> bool:
        since = self.faults.stalled_since.get(kind)
        return since is not None and opened < since
