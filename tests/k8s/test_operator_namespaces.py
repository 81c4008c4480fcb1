"""An operator that handles a list of namespaces (``operator.watchNamespaces``) reads them with the rights the
chart gives it there, a Role in each, and nothing cluster-wide: kopf lists and watches each namespace on its
own (no CRD or namespace watch, which a Role cannot grant), against the real API server, as an identity that
may not list the cluster."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_harness.controlplane import ControlPlane, write_kubeconfig
from kubernetes import client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from tests.eventually import eventually

from phalanx.api.elasticjob import GROUP, PLURAL, VERSION
from phalanx.api.settings import OperatorSettings
from phalanx.operator.executor import Executor
from phalanx.operator.handlers import Reconciler

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
HANDLED, OTHER = ("team-a", "team-b"), "team-c"
IDENTITY = "namespaced-operator"


def _operator_rules() -> list[dict[str, Any]]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "operator-rbac.yaml").read_text())
    role = next(
        d for d in docs if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == "phalanx-operator"
    )
    return list(role["rules"])


def _job(name: str, namespace: str) -> dict[str, Any]:
    container = {"name": "trainer", "image": "x", "command": ["python", "train.py"]}
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": namespace},
        # Only read here: the session's operator leaves another controller's job alone.
        "spec": {"managedBy": "test.phalanx.dev/nobody", "nodes": {"min": 1, "max": 1},
                 "template": {"spec": {"containers": [container]}}},
    }  # fmt: skip


def test_an_operator_of_some_namespaces_watches_each_with_a_role_there(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    subject = {"kind": "ServiceAccount", "name": IDENTITY, "namespace": HANDLED[0]}
    objects: list[dict[str, Any]] = [
        *({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in (*HANDLED, OTHER)),
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": IDENTITY, "namespace": HANDLED[0]},
        },
    ]
    for ns in HANDLED:  # what the chart renders for operator.watchNamespaces
        meta = {"name": IDENTITY, "namespace": ns}
        objects += [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
             "rules": _operator_rules()},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": IDENTITY},
             "subjects": [subject]},
        ]  # fmt: skip
    listed = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    cp.kubectl("apply", "-f", "-", input_text=listed)
    stop: asyncio.Event | None = None
    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    try:
        token = cp.kubectl("create", "token", IDENTITY, "-n", HANDLED[0], "--duration=1h").strip()
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server=cp.server, ca=cp.ca, token=token)
        api = k8s_config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        with pytest.raises(ApiException) as refused:
            client.CustomObjectsApi(api).list_cluster_custom_object(GROUP, VERSION, PLURAL)
        assert refused.value.status == 403, "nothing cluster-wide: the namespaces' Roles only"

        settings = OperatorSettings(namespace=",".join(HANDLED))
        reconciler = Reconciler(executor=Executor(api=api, settings=settings), settings=settings)
        for ns in (*HANDLED, OTHER):
            cp.kubectl("create", "-f", "-", input_text=json.dumps(_job("j", ns)))
        loop, stop = asyncio.new_event_loop(), asyncio.Event()
        thread = threading.Thread(target=loop.run_until_complete, args=(reconciler.run(stop),), daemon=True)
        thread.start()
        eventually(reconciler.listed.is_set, timeout=30, what="kopf listing the handled namespaces")
        eventually(lambda: reconciler.jobs.idents() == [(HANDLED[0], "j"), (HANDLED[1], "j")], timeout=15,
                   what="the jobs of the handled namespaces, watched")  # fmt: skip
        assert reconciler.jobs.get(OTHER, "j") is None
        cp.kubectl("delete", "ej", "j", "-n", HANDLED[1])
        eventually(
            lambda: reconciler.jobs.idents() == [(HANDLED[0], "j")], timeout=15, what="a deletion, watched"
        )
        assert thread.is_alive(), "kopf runs on under the Roles (nothing it needs is refused)"
    finally:
        if loop is not None and stop is not None and thread is not None:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
            loop.close()
        for ns in (*HANDLED, OTHER):
            cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)
