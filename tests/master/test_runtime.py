"""The executor's coalescing: many job changes -> few state saves and at most ~2 status publishes/s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import pytest

from phalanx.api import views
from phalanx.api.errors import MasterFenced, StateStoreError
from phalanx.master.job import Job
from phalanx.master.serve import runtime
from phalanx.master.serve.logstore import LogStore
from phalanx.master.serve.runtime import FENCE_CHECK_S, Runtime
from phalanx.master.store.stores import MemoryStateStore, SpecView

from .sim import Sim, settings


class ListSink:
    def __init__(self) -> None:
        self.published: list[views.JobView] = []
        self.view: SpecView | None = None

    def publish(self, status: views.JobView) -> None:
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
    assert len(sink.published[-1].waiting) == 0
    assert sink.published[-1].nodes_alive == 50


@pytest.mark.timeout(20)
def test_changes_spread_over_time_are_saved_a_few_times_and_a_waiter_is_saved_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nodes registering one by one, the loop turning between them, as a thousand agents' calls arrive: the
    saver writes after the first and then waits out its gap (made longer than the test here, so the count
    does not depend on the machine's speed), while a save someone waits for (a round before its COMPLETE
    answer) goes at once."""
    monkeypatch.setattr(runtime, "SAVE_GAP_S", 60.0)

    async def scenario() -> tuple[MemoryStateStore, int]:
        job = Job(settings=settings(rendezvous={"min_nodes": 1, "max_nodes": 200}), now=0.0)
        store = MemoryStateStore()
        rt = Runtime(job=job, logs=LogStore(ring_lines=10, max_line_bytes=100, path=None), store=store,
                     sink=ListSink())  # fmt: skip
        saver = asyncio.create_task(rt.saver())
        sim = Sim(job)
        for i in range(200):
            sim.register(f"n{i}")
            rt.after()
            await asyncio.sleep(0.001)
        during_burst = store.saves
        await rt.wait_saved(job.durable_version)  # returns long before the gap: the waiter goes first
        saver.cancel()
        await asyncio.gather(saver, return_exceptions=True)
        return store, during_burst

    store, during_burst = asyncio.run(scenario())
    assert during_burst <= 2, f"{during_burst} saves for 200 changes: the gap did not hold them"
    assert store.state is not None
    assert len(store.state["nodes"]) == 200


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
    published = [(s.phase, s.spec_generation) for s in sink.published]
    assert ("Suspended", 2) in published
    assert published[-1] == ("Pending", 3)


class TakenOverStore(MemoryStateStore):
    """Holds the state until ``taken``; then, as a ConfigMap another master claimed, refuses every save.
    With ``unreachable``, it cannot tell at all (the API server is cut off)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = False
        self.unreachable = False
        self.revoked = False

    def holds(self) -> bool:
        if self.revoked:
            raise MasterFenced(
                "the API server no longer accepts this master's credentials (401 Unauthorized)"
            )
        if self.unreachable:
            raise StateStoreError("cannot read the state ConfigMap: connection refused")
        return not self.taken

    def save(self, state: Mapping[str, Any]) -> None:
        if self.taken:
            raise MasterFenced("master new took over")
        super().save(state)


def _runtime(store: MemoryStateStore) -> tuple[Runtime, ListSink]:
    job = Job(settings=settings(rendezvous={"min_nodes": 1, "max_nodes": 2}), now=0.0)
    sink = ListSink()
    return Runtime(job=job, logs=LogStore(ring_lines=10, max_line_bytes=100, path=None), store=store,
                   sink=sink), sink  # fmt: skip


@pytest.mark.timeout(20)
def test_a_master_another_took_over_from_stops_and_publishes_nothing_more() -> None:
    async def scenario() -> tuple[Runtime, ListSink, float]:
        store = TakenOverStore()
        rt, sink = _runtime(store)
        tasks = [asyncio.create_task(t) for t in (rt.fence(), rt.publisher(), rt.saver())]
        await asyncio.sleep(0.3)
        store.taken = True
        taken = time.monotonic()
        await asyncio.wait_for(rt.stopping.wait(), FENCE_CHECK_S + 2)
        stopped = time.monotonic() - taken
        published = len(sink.published)
        Sim(rt.job).register("late")  # a change after the stop: neither saved nor published
        rt.after()
        await asyncio.sleep(1.2)
        assert len(sink.published) == published
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return rt, sink, stopped

    rt, _, stopped = asyncio.run(scenario())
    assert rt.fenced == "another master took over the job's state"
    assert stopped <= FENCE_CHECK_S + 0.5


@pytest.mark.timeout(20)
def test_a_save_refused_for_another_holder_stops_the_master_at_once() -> None:
    async def scenario() -> Runtime:
        store = TakenOverStore()
        store.taken = True
        rt, _ = _runtime(store)
        task = asyncio.create_task(rt.saver())
        Sim(rt.job).register("a")
        rt.after()
        await asyncio.wait_for(rt.stopping.wait(), 2)
        await asyncio.gather(task, return_exceptions=True)
        return rt

    rt = asyncio.run(scenario())
    assert "took over" in rt.fenced
    assert rt.save_failures == 0, "not a failed save to retry"


@pytest.mark.timeout(20)
def test_a_master_cut_off_from_its_state_stops_after_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "FENCE_CHECK_S", 0.05)
    monkeypatch.setattr(runtime, "FENCE_LEASE_S", 0.5)

    async def scenario() -> tuple[Runtime, float]:
        store = TakenOverStore()
        rt, _ = _runtime(store)
        task = asyncio.create_task(rt.fence())
        await asyncio.sleep(0.2)
        assert not rt.stopping.is_set()
        store.unreachable = True
        cut = time.monotonic()
        await asyncio.wait_for(rt.stopping.wait(), 3)
        await asyncio.gather(task, return_exceptions=True)
        return rt, time.monotonic() - cut

    rt, after = asyncio.run(scenario())
    assert 0.5 - 0.1 <= after < 1.5, "not at the first failed check: the lease covers a hiccup"
    assert "could not tell" in rt.fenced


@pytest.mark.timeout(20)
def test_a_master_whose_credentials_were_revoked_stops_at_the_next_check() -> None:
    async def scenario() -> Runtime:
        store = TakenOverStore()
        rt, _ = _runtime(store)
        task = asyncio.create_task(rt.fence())
        store.revoked = True  # its Pod was deleted: the token bound to it is refused
        await asyncio.wait_for(rt.stopping.wait(), FENCE_CHECK_S + 2)
        await asyncio.gather(task, return_exceptions=True)
        return rt

    assert "401" in asyncio.run(scenario()).fenced, "at once, not after the lease"
