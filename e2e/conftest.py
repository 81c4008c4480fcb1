"""The cluster the e2e scenarios run against, with phalanx installed the way people install it: `helm
install` of charts/phalanx (the operator Deployment, its RBAC, the CRD).

* ``PHALANX_E2E_KUBECONFIG`` set: that cluster (kind, or any other), with the images named by
  ``PHALANX_E2E_IMAGE`` (the Dockerfile's ``base`` target: operator and masters) and
  ``PHALANX_E2E_TRAIN_IMAGE`` (``train``: workers). See e2e/README.md.
* Otherwise (``make test``, CI): a control plane started here from the binaries of scripts/go-tools and
  two real nodes (a kubelet each, with containerd and runc, CNI, kube-proxy, CoreDNS and NetworkPolicies
  enforced on the first node's Pods: see tests/k8s/k8s_harness/nodes.py) running the images scripts/images
  builds here. Without the binaries, the host packages or helm the scenarios skip with a loud reason, except
  under CI=true, where that is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests import release
from tests.gotools import go_built

from e2e.kube import Helm, Kube

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "phalanx"
RELEASE, RELEASE_NAMESPACE = "phalanx", "phalanx-e2e"
STUCK_POD_TIMEOUT_S = 30
"""The operator's stuck_pod_timeout_s here (the chart's default is 120 s)."""


@dataclass(frozen=True)
class Target:
    kube: Kube
    helm: Helm
    image: str
    """The operator's and masters' image."""
    train_image: str
    """The workers' image."""
    chart_values: tuple[str, ...] = ()
    """Extra ``--set`` values of the chart for this cluster."""
    power_off: Callable[[str], None] | None = None
    """Kills a Node's machine (kubelet, runtime, containers) by name, where the cluster lets the tests."""
    power_on: Callable[[str], None] | None = None
    """Brings a Node that :attr:`power_off` killed back, empty, as a rebooted machine."""
    stop_kubelet: Callable[[str], None] | None = None
    """Kills a Node's kubelet only (its containers run on), where the cluster lets the tests."""
    start_kubelet: Callable[[str], None] | None = None
    """Starts the kubelet :attr:`stop_kubelet` killed again."""
    storage: Callable[[str], str] | None = None
    """Makes a ReadWriteMany PersistentVolumeClaim in a namespace that every node mounts; returns its name."""
    pods_reachable: bool = False
    """Whether this machine reaches Pod IPs (a Prometheus started here scrapes them)."""
    guarded_node: str = ""
    """The one node whose Pods the cluster's network plugin holds to NetworkPolicies; "" for every node (an
    external cluster must enforce them: kind's kindnet does since kind 0.24)."""
    kueue: Callable[[], contextlib.AbstractContextManager[object]] | None = None
    """Runs Kueue against the cluster for the scenarios that need it (None: the cluster must have it, with
    ElasticJob.v1alpha1.phalanx.dev in its integrations.externalFrameworks)."""
    root_image: str = ""
    """An image whose user is root, as most vendor training images' (the base image so changed); "" where the
    cluster has none, and the scenario of a root image is left out."""

    def shared_storage(self, namespace: str) -> str:
        if self.storage is None:
            pytest.fail("this cluster gives the scenarios no shared storage (Target.storage)")
        return self.storage(namespace)


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"E2E CANNOT RUN: {reason} (CI=true: a skipped e2e scenario is a failure)")
    pytest.skip(f"E2E CANNOT RUN: {reason}")


def _helm_binary() -> str:
    found = shutil.which("helm")
    if os.environ.get("PHALANX_E2E_KUBECONFIG") and found:
        return found
    return go_built("helm", unchecked="no e2e scenario runs (or install helm for an external cluster)")


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    home = tmp_path_factory.mktemp("helm-home")
    external = os.environ.get("PHALANX_E2E_KUBECONFIG")
    if external:
        image, train = os.environ.get("PHALANX_E2E_IMAGE"), os.environ.get("PHALANX_E2E_TRAIN_IMAGE")
        if not image or not train:
            pytest.fail("PHALANX_E2E_KUBECONFIG needs PHALANX_E2E_IMAGE and PHALANX_E2E_TRAIN_IMAGE too")
        kubeconfig = Path(external).expanduser()
        kube = Kube(os.environ.get("PHALANX_E2E_KUBECTL", "kubectl"), kubeconfig)
        helm = Helm(_helm_binary(), home, kubeconfig)
        kind = os.environ.get("PHALANX_E2E_KIND_CLUSTER")
        if not kind:
            yield Target(kube, helm, image, train)
            return
        # kind (e2e/kind/): a node is a Docker container; e2e/kind/cluster.yaml mounts one host folder into
        # every node at /shared, for the shared volume.
        shared = Path(os.environ.get("PHALANX_E2E_KIND_SHARED", "/tmp/phalanx-kind-shared"))
        yield Target(
            kube, helm, image, train,
            power_off=lambda node: subprocess.run(["docker", "kill", node], check=True),
            power_on=lambda node: subprocess.run(["docker", "start", node], check=True),
            storage=lambda namespace: _host_claim(kube, shared, Path("/shared"), namespace),
        )  # fmt: skip
        return
    own = _own_cluster(home)
    release.when_done("e2e/", own.close)  # idle after the scenarios, the cluster would load the other tests
    yield from own


def _host_claim(kube: Kube, here: Path, on_nodes: Path, namespace: str) -> str:
    """A claim bound to a folder of this machine that every node mounts (``here`` on this machine,
    ``on_nodes`` on the nodes), as an NFS share would be on a real cluster (a PersistentVolumeClaim is
    allowed at the restricted level; a hostPath volume is not)."""
    directory = here / namespace
    directory.mkdir(parents=True)
    directory.chmod(0o777)  # the image's user writes there; hostPath volumes ignore fsGroup
    name = f"shared-{namespace}"[:63]
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "10Gi"},
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(on_nodes / namespace), "type": "Directory"},
            "claimRef": {"namespace": namespace, "name": "shared"},
        },
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "shared", "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": name,
            "resources": {"requests": {"storage": "10Gi"}},
        },
    }
    kube(
        "apply",
        "-f",
        "-",
        input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": [volume, claim]}),
    )
    return "shared"


def _own_cluster(home: Path) -> Iterator[Target]:
    """A control plane and two real nodes (kubelet, containerd, runc) on this machine, the images built and
    imported into each node's containerd (tests/k8s/k8s_harness/containers.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "k8s"))
    from k8s_harness import containers
    from k8s_harness import kueue as kueue_harness
    from k8s_harness.controlplane import find_binaries
    from k8s_harness.nodes import missing_host_tools

    bin_dir = find_binaries()
    if bin_dir is None or not (bin_dir / "kubelet").exists():
        _missing("no Kubernetes binaries with a kubelet: run `make e2e-prepare` (needs Go)")
    if missing := missing_host_tools():
        _missing(f"this machine cannot run container nodes: missing {missing} (scripts/host-packages)")
    helm = _helm_binary()
    state = Path(tempfile.mkdtemp(prefix="phalanx-e2e-"))
    # A lost node is noticed after 20 s rather than the default 50 s: a scenario waits for it.
    try:
        with containers.running(state, node_monitor_grace_s=20) as (cp, nodes, images):
            kube = Kube(str(cp.bin_dir / "kubectl"), cp.kubeconfig)
            yield Target(
                kube,
                Helm(helm, home, cp.kubeconfig),
                images["phalanx"].ref,
                images["phalanx-train"].ref,
                # Nothing is ever pulled: a missing image is an error, not a pull. The operator runs on the
                # first node, so a scenario can lose the other one without losing it.
                (
                    "image.pullPolicy=Never",
                    f"operator.nodeSelector.kubernetes\\.io/hostname={nodes.names[0]}",
                ),
                power_off=nodes.power_off,
                power_on=nodes.power_on,
                stop_kubelet=nodes.stop_kubelet,
                start_kubelet=nodes.start_kubelet,
                storage=lambda namespace: _host_claim(kube, state / "volumes", state / "volumes", namespace),
                root_image=images["phalanx-as-root"].ref,
                pods_reachable=True,  # the nodes' bridge is this machine's
                guarded_node=nodes.names[0],  # kube-router's firewall (tests/k8s/k8s_harness/netpol.py)
                # Kueue's manager on this machine, its webhooks on 127.0.0.1, where the API server runs
                kueue=lambda: kueue_harness.running(
                    binary=cp.bin_dir / "kueue",
                    kubeconfig=cp.kubeconfig,
                    kubectl=cp.bin_dir / "kubectl",
                    state=state,
                ),
            )
    finally:  # also when the generator is closed early (tests/release.py)
        if os.environ.get("PHALANX_K8S_KEEP") == "1":
            print(f"\nkept the e2e control plane's state in {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def phalanx(target: Target) -> Iterator[Target]:
    """phalanx installed by its Helm chart, the operator running."""
    repository, _, tag = target.image.rpartition(":")
    target.helm(
        "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", "operator.reconcileIntervalSeconds=1",
        # A job whose Pods cannot start fails after this rather than the default 120 s, so that the scenario
        # that waits for it does not idle two minutes.
        "--set", f"operator.stuckPodTimeoutSeconds={STUCK_POD_TIMEOUT_S}",
        # One replica: the node-loss scenario spares the operator's node (tests/k8s/test_operator_ha.py runs
        # two replicas and kills the leader).
        "--set", "operator.replicas=1",
        # A master whose node stops answering is evicted after 5 s rather than the default 30 s: a scenario
        # waits for it (on top of the 20 s a silent node takes to turn NotReady here).
        "--set", "operator.masterNodeLostSeconds=5",
        # Every scenario runs over TLS: the operator issues each master a certificate for its Service name,
        # which the agents verify through cluster DNS (the process kubelet's rewritten addresses cannot).
        "--set", "operator.masterTLS.enabled=true",
        # The metrics token without a PodMonitor (no prometheus-operator here): a plain Prometheus scrapes the
        # masters with deploy/prometheus-scrape.yaml.
        "--set", "metricsToken.enabled=true",
        *(arg for value in target.chart_values for arg in ("--set", value)),
    )  # fmt: skip
    with contextlib.ExitStack() as stop:
        stop.callback(
            target.helm, "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", "--timeout", "60s"
        )
        release.when_done("e2e/", stop.close)  # before the cluster it runs on (tests/release.py)
        target.kube(
            "rollout", "status", f"deployment/{RELEASE}-operator", "-n", RELEASE_NAMESPACE, "--timeout=120s"
        )
        yield target


@pytest.fixture
def ns(phalanx: Target, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the scenario's own that enforces the restricted Pod Security level, deleted afterwards
    (with everything the job made in it)."""
    name = f"e2e-{request.node.name.removeprefix('test_')[:40].replace('_', '-')}-{uuid.uuid4().hex[:5]}"
    phalanx.kube("create", "namespace", name)
    phalanx.kube("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    yield name
    phalanx.kube("delete", "namespace", name, "--wait=false")


@pytest.hookimpl(trylast=True)  # after the scenario's own fixtures (its namespace) were torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    release.leaving(item.nodeid, nextitem.nodeid if nextitem is not None else None)
