"""The ElasticJob scenarios a user of any cluster relies on, through kubectl alone: the example trains to
success, a worker Pod deleted mid-run is replaced and the job still succeeds, a suspended job frees its
worker Pods and resumes to success, an invalid spec is refused at admission with a message that says what to
fix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import Target

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(420)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elasticjob.yaml"
EXAMPLE_IMAGE = "ghcr.io/phalanx-dev/phalanx:0.1.0"


@pytest.fixture
def ns(phalanx: Target, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the scenario's own, deleted afterwards (with everything the job made in it)."""
    name = f"e2e-{request.node.name.removeprefix('test_')[:40].replace('_', '-')}-{uuid.uuid4().hex[:5]}"
    phalanx.kube("create", "namespace", name)
    yield name
    phalanx.kube("delete", "namespace", name, "--wait=false")


def _apply_example(t: Target, ns: str, *, steps: int, step_s: float) -> None:
    text = EXAMPLE.read_text()
    assert EXAMPLE_IMAGE in text, "the example's image changed: update the e2e scenarios"
    assert 'value: "30"' in text, "the example's step count changed: update the e2e scenarios"
    text = text.replace(EXAMPLE_IMAGE, t.train_image).replace('value: "30"', f'value: "{steps}"')
    text = text.replace(
        "- name: TINY_STEPS",
        f'- name: TINY_STEP_S\n              value: "{step_s}"\n            - name: TINY_STEPS',
    )
    t.kube("apply", "-n", ns, "-f", "-", input_text=text)


def _status(t: Target, ns: str) -> dict[str, Any]:
    return dict(t.kube.get("ej", "tiny", "-n", ns).get("status", {}))


def _succeeded(t: Target, ns: str, *, timeout: float) -> dict[str, Any]:
    t.kube.wait_for(
        "job Succeeded", lambda: _status(t, ns).get("phase") == "Succeeded", timeout=timeout, namespace=ns
    )
    return _status(t, ns)


def _workers(t: Target, ns: str) -> list[dict[str, Any]]:
    pods = t.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=worker")["items"]
    return [
        p
        for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def _training(t: Target, ns: str) -> None:
    """Waits until both workers run and the job has stepped a few times."""
    t.kube.wait_for(
        "training progress",
        lambda: _status(t, ns).get("step", -1) >= 3 and len(_workers(t, ns)) == 2,
        timeout=240,
        namespace=ns,
    )


def test_the_example_trains_to_success(phalanx: Target, ns: str) -> None:
    _apply_example(phalanx, ns, steps=20, step_s=0.1)
    status = _succeeded(phalanx, ns, timeout=240)
    assert status["step"] >= 19, status
    assert status["worldSize"] == 4, status
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Succeeded"] == "True", conditions
    events = phalanx.kube.get("events", "-n", ns, "--field-selector", "involvedObject.kind=ElasticJob")
    reasons = {e["reason"] for e in events["items"]}
    assert {"Created", "MasterCreated", "WorkerCreated", "Succeeded"} <= reasons, reasons


def test_a_deleted_worker_pod_is_replaced_and_the_job_succeeds(phalanx: Target, ns: str) -> None:
    _apply_example(phalanx, ns, steps=80, step_s=0.2)
    _training(phalanx, ns)
    victim = sorted(_workers(phalanx, ns), key=lambda p: p["metadata"]["name"])[0]
    # The node is gone at once, as when its machine dies: no grace period for the agent.
    phalanx.kube("delete", "pod", victim["metadata"]["name"], "-n", ns, "--grace-period=0", "--force")
    phalanx.kube.wait_for(
        "a replacement worker Running",
        lambda: (
            len(_workers(phalanx, ns)) == 2
            and victim["metadata"]["uid"] not in {p["metadata"]["uid"] for p in _workers(phalanx, ns)}
        ),
        timeout=120,
        namespace=ns,
    )
    status = _succeeded(phalanx, ns, timeout=300)
    assert status["step"] >= 79, status
    assert int(status["round"]) >= 2, f"the survivors re-formed with the replacement: {status}"


def test_an_invalid_spec_is_refused_with_what_to_fix(phalanx: Target, ns: str) -> None:
    bad = (
        "apiVersion: phalanx.dev/v1alpha1\nkind: ElasticJob\nmetadata: {name: bad}\n"
        "spec:\n  nodes: {min: 3, max: 2}\n  nprocPerNode: 1\n"
        "  template: {spec: {containers: [{name: t, image: x, command: [python, t.py]}]}}\n"
    )
    out = phalanx.kube("apply", "-n", ns, "-f", "-", input_text=bad, check=False)
    assert "nodes.min must not be greater than nodes.max" in out, out
    assert "bad" not in phalanx.kube("get", "ej", "-n", ns, "-o", "name"), "nothing was created"


def test_a_suspended_job_frees_its_workers_and_resumes_to_success(phalanx: Target, ns: str) -> None:
    _apply_example(phalanx, ns, steps=150, step_s=0.2)
    _training(phalanx, ns)
    master = phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=master")["items"][0]
    phalanx.kube("patch", "ej", "tiny", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    phalanx.kube.wait_for(
        "job Suspended with no worker Pod",
        lambda: (
            _status(phalanx, ns).get("phase") == "Suspended"
            and not phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=worker")["items"]
        ),
        timeout=120,
        namespace=ns,
    )
    masters = phalanx.kube.get("pods", "-n", ns, "-l", "phalanx.dev/role=master")["items"]
    assert [p["metadata"]["uid"] for p in masters] == [master["metadata"]["uid"]], "the master Pod stays"
    phalanx.kube("patch", "ej", "tiny", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    status = _succeeded(phalanx, ns, timeout=300)
    assert status.get("replacements", 0) == 0, status
    assert status.get("evictions", []) == [], status
    events = phalanx.kube.get("events", "-n", ns, "--field-selector", "involvedObject.kind=ElasticJob")
    reasons = {e["reason"] for e in events["items"]}
    assert {"Suspending", "Suspended", "Resumed", "Succeeded"} <= reasons, reasons
