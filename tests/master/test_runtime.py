"""The executor's coalescing: many job changes -> few state saves and at most ~2 status publishes/s."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from phalanx.master.job import Job
from phalanx.master.logstore import LogStore
from phalanx.master.runtime import Runtime
from phalanx.master.state import MemoryStateStore, SpecView

from .sim import Sim, settings


class ListSink:
    def __init__(self) -> None:
        self.published: list[Mapping[str, Any]] = []
        self.view: SpecView | None = None

    def publish(self, status: Mapping[str, Any]) -> None:
        self.published.append(status)

    def spec(self) -> SpecView | None:
        return self.view


@pytest.mark.timeout(20)
def test_saves_and_publishes_are_coalesced() -> None:
    async def scenario() -> tuple[MemoryStateStore, ListSink, Job]:
        job = Job(settings=settings(rendezvous={"min_nodes": 1, "max_nodes": 50}), now=0.0)
        store, sink = MemoryStateStore(), ListSink()
        rt = Runtime(
            job=job,
            logs=LogStore(ring_lines=10, max_line_bytes=100, path=None),
            store=store,
            sink=sink,
        )
        tasks = [asyncio.create_task(rt.saver()), asyncio.create_task(rt.publisher())]
        sim = Sim(job)
        for i in range(50):  # 50 durable changes in a burst
            sim.register(f"n{i}")
            rt.after()
        await asyncio.sleep(0.1)
        version = job.durable_version
        await rt.wait_saved(version)
        await asyncio.sleep(1.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return store, sink, job

    store, sink, _ = asyncio.run(scenario())
    assert store.state is not None
    assert len(store.state["nodes"]) == 50  # the newest state was saved ...
    assert store.saves < 10  # ... in a few writes, not one per change
    assert 1 <= len(sink.published) <= 4  # ~2/s over ~1.3 s
    assert len(sink.published[-1]["waiting"]) == 0
    assert sink.published[-1]["nodes_alive"] == 50


@pytest.mark.timeout(20)
def test_the_job_follows_the_spec_the_sink_reads_and_publishes_its_generation() -> None:
    async def scenario() -> tuple[ListSink, list[bool]]:
        job = Job(settings=settings(rendezvous={"min_nodes": 1, "max_nodes": 2}), now=0.0)
        sink = ListSink()
        rt = Runtime(job=job, logs=LogStore(ring_lines=10, max_line_bytes=100, path=None),
                     store=MemoryStateStore(), sink=sink)  # fmt: skip
        task = asyncio.create_task(rt.publisher())
        seen = []
        for view in (None, SpecView(suspend=True, generation=2), SpecView(suspend=False, generation=3)):
            sink.view = view
            await asyncio.sleep(1.2)
            seen.append(job.suspended)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sink, seen

    sink, seen = asyncio.run(scenario())
    assert seen == [False, True, False]
    published = [(s["phase"], s["spec_generation"]) for s in sink.published]
    assert ("Suspended", 2) in published
    assert published[-1] == ("Pending", 3)
