"""The pure parts of leader election (what a candidate does with the Lease as read) and of the operator's
memory of kopf's watches (which copy of an object wins, ghosts), and when a new leader may run its first pass.
The I/O around them runs against the real control plane in tests/k8s/test_operator_ha.py and
tests/k8s/test_operator_watches.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from phalanx.api.errors import ConfigError
from phalanx.api.settings import OperatorSettings
from phalanx.operator.executor import Executor
from phalanx.operator.handlers import Reconciler, pod_key
from phalanx.operator.leader import LeaseTiming, Observation, decide
from phalanx.operator.memory import OVERLAY_S, KindMemory, newer

TIMING = LeaseTiming(lease_s=8, renew_deadline_s=5, retry_s=1)


def _lease(holder: str, renew: str = "t1", version: str = "10") -> dict[str, Any]:
    return {"metadata": {"resourceVersion": version}, "spec": {"holderIdentity": holder, "renewTime": renew}}


def test_no_lease_is_created_and_a_free_or_own_lease_is_taken() -> None:
    assert decide(None, identity="a", last=None, now=0, timing=TIMING)[0] == "create"
    assert decide(_lease(""), identity="a", last=None, now=0, timing=TIMING)[0] == "take"
    assert decide(_lease("a"), identity="a", last=None, now=0, timing=TIMING)[0] == "take"


def test_anothers_lease_is_taken_only_after_it_went_unrenewed_for_its_duration_on_our_clock() -> None:
    what, seen = decide(_lease("b"), identity="a", last=None, now=100, timing=TIMING)
    assert what == "wait"
    assert seen == Observation(("b", "t1", "10"), 100)
    # The same record 7.9 s later (by our clock, whatever the holder's says): still the holder's.
    assert decide(_lease("b"), identity="a", last=seen, now=107.9, timing=TIMING) == ("wait", seen)
    # A renewal resets the wait.
    what, renewed = decide(_lease("b", "t2", "11"), identity="a", last=seen, now=107.9, timing=TIMING)
    assert what == "wait"
    assert renewed is not None
    assert renewed.seen_at == 107.9
    assert decide(_lease("b", "t2", "11"), identity="a", last=renewed, now=115.8, timing=TIMING)[0] == "wait"
    assert decide(_lease("b", "t2", "11"), identity="a", last=renewed, now=115.9, timing=TIMING)[0] == "take"


def test_the_holder_stops_acting_before_a_standby_may_take_over() -> None:
    # The holder acts until renew_deadline_s after the start of its last successful renewal; a standby
    # sees that renewal no earlier than its start and waits lease_s after seeing it.
    assert TIMING.renew_deadline_s < TIMING.lease_s
    with pytest.raises(ValueError, match="retry_s < renew_deadline_s < lease_s"):
        LeaseTiming(lease_s=5, renew_deadline_s=5, retry_s=1)
    # Killing the leader hands over within lease_s + retry_s (plus the new leader's start) < 15 s.
    assert LeaseTiming().lease_s + LeaseTiming().retry_s < 15


def test_resource_versions_order_the_copies() -> None:
    assert newer("11", "10")
    assert not newer("10", "10")  # the watch delivering what a write-through already stored
    assert not newer("9", "10")
    assert newer("x", "10")  # not an etcd revision: never stuck on the old copy


def _pod(name: str, job: str, version: str, ns: str = "n") -> dict[str, Any]:
    meta = {"name": name, "namespace": ns, "resourceVersion": version, "labels": {"phalanx.dev/job": job}}
    return {"metadata": meta}


def _memory(index: dict[Any, list[Any]], clock: Callable[[], float] = lambda: 0.0) -> KindMemory:
    """A memory over ``index``, standing in for kopf's (a Mapping of key -> the objects filed there)."""
    memory = KindMemory("pods", key=pod_key, clock=clock)
    loop = asyncio.new_event_loop()
    memory.attach(index, loop)
    loop.close()  # kopf's loop, the index's only writer, is not running: the test's thread reads directly
    return memory


def test_own_writes_are_seen_until_the_index_has_them_or_newer() -> None:
    now = [0.0]
    index: dict[Any, list[Any]] = {("n", "a"): [_pod("p0", "a", "5")]}
    memory = _memory(index, clock=lambda: now[0])
    memory.put(_pod("p1", "a", "6"))  # the answer to the operator's create: the watch has not delivered it
    memory.put(_pod("p0", "a", "9"))  # the answer to its patch
    assert sorted(p["metadata"]["name"] for p in memory.by_index(("n", "a"))) == ["p0", "p1"]
    assert memory.get("n", "p0")["metadata"]["resourceVersion"] == "9", "the own, newer copy wins"
    index[("n", "a")] = [_pod("p0", "a", "10"), _pod("p1", "a", "6")]  # the watch caught up
    assert memory.get("n", "p0")["metadata"]["resourceVersion"] == "10"
    assert len(memory.by_index(("n", "a"))) == 2
    assert memory._written == {}, "own copies are dropped once the index holds them"
    memory.put(_pod("p2", "a", "11"))  # never delivered (the watch lost it): not held for ever
    now[0] += OVERLAY_S + 1
    assert memory.get("n", "p2") is None
    assert memory.by_index(("n", "c")) == []


def test_an_answer_read_after_the_watch_reported_the_deletion_does_not_bring_the_object_back() -> None:
    """A Pod deleted at once (a forced deletion): the watch's DELETED event can be read before the DELETE's
    own answer, an older copy of the Pod, is written through; the memory must not hold a Pod that is gone."""
    index: dict[Any, list[Any]] = {}
    memory = _memory(index)
    memory.put(_pod("master", "j", "5"))
    memory.forget(("n", "master"), "7")  # the watch's DELETED
    memory.put(_pod("master", "j", "6"))  # the DELETE's answer: the Pod as it was before
    assert memory.get("n", "master") is None
    memory.put(_pod("master", "j", "9"))  # created again under the same name
    assert memory.get("n", "master")["metadata"]["resourceVersion"] == "9"


def test_a_relist_is_told_apart_and_its_ghosts_are_buried_but_not_what_came_after_the_list() -> None:
    """kopf re-lists after 410 Gone and keeps in its index what was deleted meanwhile (a ghost). A LIST made
    after the re-list buries what it lacks, unless that is newer than the LIST (created after it)."""
    index: dict[Any, list[Any]] = {("n", "a"): [_pod("p0", "a", "5"), _pod("p1", "a", "6")]}
    memory = _memory(index)
    assert not memory.seen(_pod("p0", "a", "5"), listed=True), "the first listing is no re-list"
    assert not memory.seen(_pod("p1", "a", "6"), listed=False)
    assert memory.seen(_pod("p0", "a", "5"), listed=True), "listed again: kopf re-listed"
    index[("n", "a")].append(_pod("p2", "a", "30"))  # created after the LIST below, and watched
    buried = memory.bury({("n", "p0"): "5"}, "20")
    assert [p["metadata"]["name"] for p in buried] == ["p1"]
    assert sorted(p["metadata"]["name"] for p in memory.by_index(("n", "a"))) == ["p0", "p2"]
    assert memory.idents() == [("n", "p0"), ("n", "p2")]
    assert memory.bury({("n", "p0"): "5"}, "21") == [], "a ghost is buried once"
    # Made again under the same name: kopf files it by its new uid, beside the ghost it keeps.
    memory.seen(_pod("p1", "a", "40"), listed=False)
    index[("n", "a")] = [_pod("p0", "a", "5"), _pod("p1", "a", "40"), _pod("p1", "a", "6")]
    assert memory.get("n", "p1")["metadata"]["resourceVersion"] == "40"
    assert sorted(p["metadata"]["resourceVersion"] for p in memory.by_index(("n", "a"))) == ["40", "5"]


def test_the_operators_namespaces_are_a_list_of_names() -> None:
    assert OperatorSettings(namespace=" team-a, team-b,team-a ").namespaces == ("team-a", "team-b")
    assert OperatorSettings().namespaces == ()
    with pytest.raises(ConfigError, match="Team_B"):
        OperatorSettings(namespace="team-a,Team_B")


def _passes(executor: Executor) -> float:
    return sum(executor.metrics.passes.labels(result=r)._value.get() for r in ("ok", "error"))


def test_no_pass_runs_before_the_jobs_and_the_pods_are_both_listed() -> None:
    """A new leader's jobs watch delivers changes (the master's status patches) while its Pods may still be
    being listed: a pass then would see the job without its Pods and replace every one of them, on any
    machine (a replacement landed on the machine it was evicted from in tests/k8s/test_operator_ha.py).
    Such triggers run no pass; the first periodic round, once kopf filled its indices, passes every job.
    Nothing listens at the API address: a pass that ran fails on its first read and is counted."""
    settings = OperatorSettings()
    nowhere = client.Configuration(host="http://127.0.0.1:9")
    nowhere.retries = 0  # fail at the first refused connection
    api = client.ApiClient(nowhere)
    job = {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "ElasticJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u", "resourceVersion": "7", "generation": 1},
        "spec": {},
        "status": {"evictions": [{"nodeId": "j-worker-0-0"}]},
    }
    early = Reconciler(executor=Executor(api=api, settings=settings), settings=settings)
    early.jobs.put(job)  # the jobs are listed; kopf has not called a handler yet (the Pods' LIST is out)
    early.trigger("ns", "j")  # what a handler or the periodic round asks for
    early._pool.shutdown(wait=True)
    assert _passes(early.executor) == 0

    listed = Reconciler(executor=Executor(api=api, settings=settings), settings=settings)
    listed.jobs.put(job)
    listed.listed.set()  # as the first handler call of a kopf run does: every index is filled
    listed.trigger("ns", "j")
    listed._pool.shutdown(wait=True)
    assert _passes(listed.executor) == 1, "once listed, a change runs a pass"
