"""The operator's watches (kopf's) under the faults a cluster brings, injected between a real operator process
and the real API server by a proxy (k8s_harness/apiproxy.py):

- no pass runs before the Pods are listed, however slow their LIST (a pass on a job without its Pods would
  replace every one of them);
- nothing kopf could write (a finalizer, an annotation) is on the job or its Pods;
- a watch that stalls without its connection closing is reopened, from where it was (no LIST);
- a Pod deleted while the watch was broken, and missing from the re-list after ``410 Gone``, does not stay
  in the operator's memory (kopf's index keeps it: a ghost): the master's Pod is made again;
- a job the operator handled is deleted at once with the operator stopped (no finalizer)."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_harness.apiproxy import ApiProxy
from k8s_harness.cluster import METRICS_TOKEN, Cluster, _stop
from k8s_harness.controlplane import free_port, write_kubeconfig

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
NS = "watches"
INACTIVITY_S = 3.0
"""The proxied operator's watch inactivity timeout (70 s in a cluster, where bookmarks come every minute)."""
LIST_DELAY_S = 8.0


def _apply_job(cluster: Cluster) -> None:
    cluster.cp.kubectl("create", "namespace", NS)
    text = (ROOT / "examples" / "elasticjob.yaml").read_text().replace('value: "30"', 'value: "3000"')
    text = text.replace(
        "- name: TINY_STEPS",
        '- name: TINY_STEP_S\n              value: "0.1"\n            - name: TINY_STEPS',
    )
    cluster.cp.kubectl("apply", "-n", NS, "-f", "-", input_text=text)


def _workers(cluster: Cluster) -> dict[str, dict[str, Any]]:
    pods = cluster.get_json("pods", "-n", NS, "-l", "phalanx.dev/role=worker")["items"]
    return {p["metadata"]["name"]: p for p in pods}


def _passes(http: str) -> float:
    request = urllib.request.Request(
        f"http://{http}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as answer:
            text = answer.read().decode()
    except OSError:  # not serving yet
        return 0.0
    found = re.findall(r'^phalanx_operator_reconcile_passes_total\{result="\w+"\} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


def _kopf_marks(obj: dict[str, Any]) -> list[str]:
    meta = obj["metadata"]
    return [*(meta.get("finalizers") or []), *(k for k in meta.get("annotations") or {} if "kopf" in k)]


def _replaced(cluster: Cluster, slot: int) -> list[str]:
    events = cluster.get_json("events", "-n", NS)["items"]
    return [
        e["message"] for e in events if e["reason"] == "WorkerReplaced" and f"slot {slot}:" in e["message"]
    ]


@pytest.mark.timeout(360)
def test_the_operators_watches_survive_a_slow_list_a_stall_and_a_relist_and_mark_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    _apply_job(cluster)
    proxy = ApiProxy(cluster.cp.server, cluster.cp.ca).start()
    operator = None
    try:
        cluster.wait_for(
            "both workers running", lambda: int((cluster.get_json("ej", "tiny", "-n", NS).get("status") or {})
                                                 .get("worldSize") or 0) == 4, timeout=120,
        )  # fmt: skip
        originals = set(_workers(cluster))
        assert originals == {"tiny-worker-0-0", "tiny-worker-1-0"}, originals

        # The harness's operator hands its Lease over; one that reaches the API server through the proxy
        # takes it, and its Pods' LIST is held back.
        _stop(cluster.operator, timeout=10)
        token = yaml.safe_load(cluster.operator_kubeconfig.read_text())["users"][0]["user"]["token"]
        kubeconfig = write_kubeconfig(
            tmp_path / "proxied", server=proxy.server, ca=cluster.cp.ca, token=token
        )
        proxy.faults.slow_lists["pods"] = LIST_DELAY_S
        http = f"127.0.0.1:{free_port()}"
        operator = cluster.spawn_operator(http, log="operator-proxied.log", env={
            "KUBECONFIG": str(kubeconfig), "PHALANX_OPERATOR_WATCH_INACTIVITY_S": str(INACTIVITY_S),
        })  # fmt: skip
        # While the Pods' LIST is held back, the jobs are listed and watched (the master patches the job's
        # status meanwhile): no pass may run.
        during: list[float] = []
        deadline = time.monotonic() + 60
        while not proxy.lists("pods") and time.monotonic() < deadline:
            during.append(_passes(http))
            time.sleep(0.2)
        assert proxy.lists("pods"), "the proxied operator never listed its Pods"
        listed_at = proxy.lists("pods")[0]
        asked_at = next(r.at for r in proxy.requests if r.kind == "pods" and not r.watch)
        assert listed_at - asked_at >= LIST_DELAY_S - 0.5, "the Pods' LIST was held back"
        jobs_listed = proxy.lists("elasticjobs")
        assert jobs_listed, "the jobs were listed"
        assert jobs_listed[0] < asked_at + 1, "the jobs were listed while the Pods' LIST was held"
        assert len(during) > 10, during
        assert max(during) == 0, f"passes ran before the Pods were listed: {during}"
        proxy.faults.slow_lists.clear()
        cluster.wait_for("a pass once listed", lambda: _passes(http) > 0, timeout=30)
        time.sleep(3)  # a few periodic passes (1 s here)
        assert set(_workers(cluster)) == originals, "a pass replaced Pods it had not yet listed"
        marked = {p: _kopf_marks(obj) for p, obj in _workers(cluster).items()}
        marked["tiny"] = _kopf_marks(cluster.get_json("ej", "tiny", "-n", NS))
        assert not any(marked.values()), marked

        # The Pods' watch stalls, its connection open: reopened within the inactivity timeout, resumed from
        # its resourceVersion (no LIST).
        stalled_at = proxy.stall("pods")
        cluster.wait_for(
            "the stalled watch reopened",
            lambda: proxy.watches("pods", since=stalled_at), timeout=4 * INACTIVITY_S,
        )  # fmt: skip
        reopened = proxy.watches("pods", since=stalled_at)[0]
        assert "resourceVersion=" in reopened.path, reopened.path
        assert [at for at in proxy.lists("pods") if at > stalled_at] == [], (
            "a stalled watch is resumed, not re-listed"
        )

        # Stalled again; the master's Pod is deleted meanwhile, and the watch's resourceVersion has expired
        # (410): kopf lists again, and the deleted Pod, missing from that LIST, stays in its index. Only the
        # operator makes a master Pod (a worker's loss would also reach it through the master's eviction).
        master_uid = cluster.get_json("pod", "tiny-master", "-n", NS)["metadata"]["uid"]
        proxy.faults.gone.add("pods")
        stalled_at = proxy.stall("pods")
        cluster.cp.kubectl("delete", "pod", "tiny-master", "-n", NS, "--grace-period=0", "--force")
        cluster.wait_for(
            "kopf re-listing the Pods after 410 Gone",
            lambda: [at for at in proxy.lists("pods") if at > stalled_at], timeout=4 * INACTIVITY_S,
        )  # fmt: skip
        relisted_at = next(at for at in proxy.lists("pods") if at > stalled_at)

        def master_again() -> bool:
            pod = cluster.cp.kubectl("get", "pod", "tiny-master", "-n", NS, "-o", "jsonpath={.metadata.uid}",
                                     check=False)  # fmt: skip
            return bool(pod.strip()) and pod.strip() != master_uid and "NotFound" not in pod

        cluster.wait_for("the ghost master Pod made again", master_again, timeout=30)
        print(
            f"\nthe deleted master Pod was made again {time.monotonic() - relisted_at:.1f}s after the re-list"
        )
        reasons = [e["reason"] for e in cluster.get_json("events", "-n", NS)["items"]]
        assert "MasterRecreated" in reasons, reasons

        # The operator stops; the job it handled goes at once.
        _stop(operator, timeout=10)
        started = time.monotonic()
        cluster.cp.kubectl("delete", "ej", "tiny", "-n", NS, "--timeout=20s")
        assert time.monotonic() - started < 10, "deleting the job waited for an operator"
    finally:
        _stop(operator, timeout=10)
        proxy.stop()
        cluster.start_operator()
        cluster.cp.kubectl("delete", "namespace", NS, "--wait=false", check=False)
