"""The pure parts of leader election (what a candidate does with the Lease as read) and of the watch caches
(which copy of an object wins), and when a new leader may run its first pass. The I/O around them runs against
the real control plane in tests/k8s/test_operator_ha.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from phalanx.api.errors import ConfigError
from phalanx.api.settings import OperatorSettings
from phalanx.operator.cache import NamespacedCaches, WatchCache, newer, watch
from phalanx.operator.executor import Executor
from phalanx.operator.handlers import Reconciler
from phalanx.operator.leader import LeaseTiming, Observation, decide

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


def test_the_cache_indexes_by_job_and_ignores_older_copies() -> None:
    cache = WatchCache(
        kind="pods",
        list_fn=lambda: None,
        index=lambda m: (m["namespace"], m["labels"].get("phalanx.dev/job")),
    )
    cache.put(_pod("p0", "a", "5"))
    cache.put(_pod("p1", "a", "6"))
    cache.put(_pod("q0", "b", "7"))
    assert sorted(p["metadata"]["name"] for p in cache.by_index(("n", "a"))) == ["p0", "p1"]
    cache.put(_pod("p0", "a", "9"))  # written through from a create/patch answer
    cache.put(_pod("p0", "a", "8"))  # a late watch event of an older version
    assert cache.get("n", "p0")["metadata"]["resourceVersion"] == "9"
    cache.remove("n", "p1")
    assert [p["metadata"]["name"] for p in cache.by_index(("n", "a"))] == ["p0"]
    assert cache.by_index(("n", "c")) == []


def test_an_answer_read_after_the_watch_reported_the_deletion_does_not_bring_the_object_back() -> None:
    """A Pod deleted at once (a forced deletion): the watch's DELETED event can be read before the DELETE's
    own answer, an older copy of the Pod, is written through; the cache must not hold a Pod that is gone."""
    cache = WatchCache(kind="pods", list_fn=lambda: None, index=lambda m: (m["namespace"], "j"))
    cache.put(_pod("master", "j", "5"))
    assert cache.apply("DELETED", _pod("master", "j", "7"))
    cache.put(_pod("master", "j", "6"))  # the DELETE's answer: the Pod as it was before
    assert cache.get("n", "master") is None
    cache.put(_pod("master", "j", "9"))  # created again under the same name
    assert cache.get("n", "master")["metadata"]["resourceVersion"] == "9"


def test_the_caches_of_several_namespaces_read_and_write_as_one() -> None:
    listed: list[tuple[str, ...]] = []

    def lister(ns: str) -> tuple[Callable[..., Any], tuple[str, ...]]:
        listed.append((ns,))
        return (lambda *_a, **_k: None), ("pods", ns)

    cache = watch("pods", namespaces=("a", "b"), lister=lister, index=lambda m: (m["namespace"], "j"))
    assert isinstance(cache, NamespacedCaches)
    assert listed == [("a",), ("b",)], "a watch of its own per namespace"
    cache.put(_pod("p0", "j", "5", ns="a"))
    cache.put(_pod("p1", "j", "6", ns="b"))
    cache.put(_pod("p2", "j", "7", ns="elsewhere"))  # not a namespace it handles: not kept
    assert [p["metadata"]["name"] for p in cache.by_index(("a", "j"))] == ["p0"]
    assert cache.get("b", "p1") is not None
    assert cache.get("elsewhere", "p2") is None
    assert sorted(cache.idents()) == [("a", "p0"), ("b", "p1")]
    cache.remove("a", "p0")
    assert cache.by_index(("a", "j")) == []
    assert isinstance(watch("pods", namespaces=(), lister=lister, index=lambda m: None), WatchCache)
    assert listed[-1] == ("",), "no namespace: the whole cluster's list"


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
    Such triggers run no pass; the first periodic round, once both caches are synced, passes every job.
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
    early.jobs.put(job)  # the jobs are listed; the Pods' LIST has not come back
    early._changed(("ns", "j"), job)  # what the jobs watch calls on a change
    early._pool.shutdown(wait=True)
    assert _passes(early.executor) == 0

    synced = Reconciler(executor=Executor(api=api, settings=settings), settings=settings)
    synced.jobs.put(job)
    synced._synced.set()  # as start() does once both caches listed everything
    synced._changed(("ns", "j"), job)
    synced._pool.shutdown(wait=True)
    assert _passes(synced.executor) == 1, "once synced, a change runs a pass"
