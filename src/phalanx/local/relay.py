"""A bad network between one node and the master, for ``phalanx local``: a TCP relay that adds latency or
cuts the link, in both directions.

A node whose faults are injected reaches the master through its own relay (``--rdzv-endpoint`` is the
relay's address). The relay behaves as TCP does over a bad network:

* with a latency L, every byte arrives L after it was sent, in order;
* while the link is cut nothing arrives and nothing is refused: no reset, no error, the two ends only see
  silence, as with a pulled cable or a dead switch. What was sent meanwhile arrives when the link heals,
  as TCP's retransmissions would deliver it; the ends' own deadlines decide what they make of it (a gRPC
  call past its deadline has given up, so its late answer is dropped). A connection opened during a cut
  reaches the master only when the link heals.

It runs in user space because ``phalanx local`` needs no privileges; only the agent's traffic with the
master goes through it, not the workers' collectives. A node in a network namespace of its own (see
:mod:`phalanx.local.fabric`) reaches its relay at a Unix socket, which every namespace can open.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from pathlib import Path

__all__ = ["Relay"]

_CHUNK = 64 * 1024


class Relay:
    """Relays ``127.0.0.1:<port>`` (or the Unix socket ``unix_path``) to ``target`` (``host:port``) on a
    thread of its own."""

    def __init__(self, target: str, *, unix_path: Path | None = None) -> None:
        self._unix_path = unix_path
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="phalanx-relay")
        self._up = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.latency_s = 0.0
        """Added to every byte's trip, each way; read at the moment the byte enters the relay."""
        self.address = ""

    def start(self) -> str:
        """Starts listening; returns the address to give the agent instead of the master's."""
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)
        self.address = f"unix:{self._unix_path}" if self._unix_path is not None else f"127.0.0.1:{port}"
        return self.address

    def cut(self) -> None:
        self._loop.call_soon_threadsafe(self._up.clear)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._up.set)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    # ---------------------------------------------------------------------------------------------
    # on the relay's loop

    async def _serve(self) -> int:
        self._up.set()
        if self._unix_path is not None:
            self._server = await asyncio.start_unix_server(self._accept, self._unix_path)
            return 0
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept(self, agent_r: asyncio.StreamReader, agent_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        master_w: asyncio.StreamWriter | None = None
        try:
            await self._up.wait()  # a SYN sent into a cut link gets no answer until it heals
            master_r, master_w = await asyncio.open_connection(*self._target)
            await asyncio.gather(self._pipe(agent_r, master_w), self._pipe(master_r, agent_w))
        except (OSError, asyncio.IncompleteReadError):
            pass  # the master is down (restarting) or a side reset: the other side sees the close
        except asyncio.CancelledError:
            pass  # closing the relay; ending quietly, since asyncio asks a server callback for its result
        finally:
            self._conns.discard(task)
            for w in (agent_w, master_w):
                if w is not None:
                    w.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """One direction: bytes are stamped when they enter and leave after ``latency_s``, in order."""
        loop = asyncio.get_running_loop()
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()
        ended = False

        async def read() -> None:
            nonlocal ended
            try:
                while data := await src.read(_CHUNK):
                    queue.append((loop.time() + self.latency_s, data))
                    arrived.set()
            finally:
                ended = True
                arrived.set()

        reader = asyncio.create_task(read())
        try:
            while True:
                if not queue:
                    if ended:
                        break
                    arrived.clear()
                    await arrived.wait()
                    continue
                due, data = queue[0]
                await asyncio.sleep(max(0.0, due - loop.time()))
                await self._up.wait()
                queue.popleft()
                dst.write(data)
                await dst.drain()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, asyncio.IncompleteReadError):
                await reader
        dst.close()  # the sender closed or reset: pass it on once everything it sent is delivered
