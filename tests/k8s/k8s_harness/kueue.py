"""Kueue's manager (scripts/go-tools builds it) run on this machine against a test cluster whose API server
runs here too, with its webhooks served over TLS on 127.0.0.1.

Its release installs it as a Deployment behind a Service, with certificates it makes for that Service's DNS
name. Here the API server is a process on this machine, so the manager is one too: its CRDs and webhook
configurations are the module's own (``kueue-config/`` beside the binaries), with each Service reference
replaced by the URL it listens on and the CA bundle of a serving certificate for 127.0.0.1 made here. Only
the webhooks of Kueue's own kinds are registered: those of the job kinds it integrates (batch Jobs, Pods,
Deployments, ...) would hold every such object of the cluster to a manager that stops with the test.

Kueue knows an ElasticJob as an external framework (``ElasticJob.v1alpha1.phalanx.dev``): the phalanx
operator creates and follows its Workloads.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from k8s_harness import certs, served
from phalanx.api.ports import free_port

EXTERNAL_FRAMEWORK = "ElasticJob.v1alpha1.phalanx.dev"
NAMESPACE = "kueue-system"
CONVERTED = ("clusterqueues", "cohorts", "localqueues", "workloads", "multikueueclusters")
"""The kinds whose CRDs its release patches with its conversion webhook (v1beta1 <-> v1beta2): those of its
config/components/crd/kustomization.yaml."""


@dataclass(frozen=True)
class Kueue:
    config_dir: Path
    log: Path


def _ca_bundle(ca: Path) -> str:
    return base64.b64encode(ca.read_bytes()).decode()


def _crds(config: Path, *, url: str, ca_bundle: str) -> list[dict[str, Any]]:
    crds = []
    for path in sorted(config.glob("kueue.x-k8s.io_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": f"{url}/convert", "caBundle": ca_bundle},
                    "conversionReviewVersions": ["v1"],
                },
            }
        crds.append(crd)
    return crds


def _webhooks(config: Path, *, url: str, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, its own kinds' webhooks only, called at ``url``."""
    configurations = []
    for doc in yaml.safe_load_all((config / "webhooks.yaml").read_text()):
        if not doc:
            continue
        hooks = [
            h for h in doc.get("webhooks") or []
            if all(r.get("apiGroups") == ["kueue.x-k8s.io"] for r in h.get("rules") or [])
        ]  # fmt: skip
        for hook in hooks:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{url}{path}", "caBundle": ca_bundle}
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}
        doc["webhooks"] = hooks
        configurations.append(doc)
    return configurations


@contextlib.contextmanager
def running(
    *, binary: Path, kubeconfig: Path, kubectl: Path, state: Path, settings: Mapping[str, Any] | None = None
) -> Iterator[Kueue]:
    """Installs Kueue's CRDs and webhooks, runs its manager until the block ends, then removes the webhooks
    (the API server would call them in vain) and stops it. ``settings``: more of its Configuration (e.g.
    ``multiKueue`` in a manager cluster)."""
    folder = state / "kueue"
    folder.mkdir(parents=True, exist_ok=True)
    config = binary.parent / "kueue-config"
    make_ca_and_cert(folder)
    port, probes, metrics = free_port(), free_port(), free_port()
    url, bundle = f"https://127.0.0.1:{port}", _ca_bundle(folder / "ca.crt")

    def kube(*args: str, text: str | None = None) -> str:
        done = subprocess.run(
            [str(kubectl), f"--kubeconfig={kubeconfig}", *args],
            input=text, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr[-2000:]}"
        return done.stdout

    objects = [*_crds(config, url=url, ca_bundle=bundle), *_webhooks(config, url=url, ca_bundle=bundle)]
    kube("apply", "--server-side", "--force-conflicts", "-f", "-",
         text=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}))  # fmt: skip
    crds = [f"crd/{o['metadata']['name']}" for o in objects if o["kind"] == "CustomResourceDefinition"]
    kube("wait", "--for=condition=Established", "--timeout=90s", *crds)  # the manager maps them at start
    kube("apply", "-f", "-", text=kube("create", "namespace", NAMESPACE, "--dry-run=client", "-o", "yaml"))
    configuration = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": port, "certDir": str(folder / "serving")},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{probes}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics}"},
        "leaderElection": {"leaderElect": False},
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
        # Its pending-workloads API is an aggregated API server of its own (an APIService, a certificate in
        # /visibility): not run here; the ClusterQueue's status says the same numbers.
        "featureGates": {"VisibilityOnDemand": False},
        **(settings or {}),
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(configuration))
    log = folder / "kueue.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    argv = [str(binary), f"--config={folder / 'config.yaml'}"]
    with log.open("ab") as out:
        process = subprocess.Popen(
            _with_metrics_certificate(argv, folder), stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        served.wait_answering(process, f"http://127.0.0.1:{probes}/readyz", log, what="kueue")
        yield Kueue(config_dir=folder, log=log)
    finally:
        names = [f"{w['kind'].lower()}/{w['metadata']['name']}" for w in objects if "webhooks" in w]
        subprocess.run([str(kubectl), f"--kubeconfig={kubeconfig}", "delete", "--ignore-not-found", *names],
                       capture_output=True, timeout=60, check=False)  # fmt: skip
        served.stop(process)


def _with_metrics_certificate(argv: list[str], folder: Path) -> list[str]:
    """``argv`` run where Kueue finds its metrics certificate: without its own certificate management it reads
    it from /etc/kueue/metrics/certs, where its release mounts a Secret. Here it sees an /etc of its own (an
    overlay in a mount namespace of its own) with the serving certificate there; this machine's /etc is not
    written."""
    etc = folder / "etc"
    certs_dir = etc / "upper" / "kueue" / "metrics" / "certs"
    certs_dir.mkdir(parents=True, exist_ok=True)
    (etc / "work").mkdir(exist_ok=True)
    for name in ("tls.crt", "tls.key"):
        (certs_dir / name).write_bytes((folder / "serving" / name).read_bytes())
    overlay = f"lowerdir=/etc,upperdir={etc / 'upper'},workdir={etc / 'work'}"
    script = f'mount -t overlay overlay -o {overlay} /etc && exec "$0" "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, *argv]


def make_ca_and_cert(folder: Path) -> None:
    """A CA and a serving certificate for 127.0.0.1, where controller-runtime looks for it (tls.crt,
    tls.key in the cert dir)."""
    certs.make_ca(folder)
    served = certs.sign(folder, name="webhook", subject="/CN=kueue-webhook",
                        ext="subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth")  # fmt: skip
    serving = folder / "serving"
    serving.mkdir(exist_ok=True)
    (serving / "tls.crt").write_bytes(served.cert.read_bytes())
    (serving / "tls.key").write_bytes(served.key.read_bytes())
