"""etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback.

Everything is per run: a fresh state directory with its own CA, serving and client certificates and
service-account signing keys; etcd keeps its data in that directory (no fsync, it is throwaway). RBAC is
on (``--authorization-mode=Node,RBAC``): the admin kubeconfig authenticates with a client certificate in
``system:masters``; the controller manager and the scheduler have their own identities.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s_harness import certs
from phalanx.api.ports import free_port

GATES = "GenericWorkload=true"
"""Feature gates of every component: GenericWorkload serves the scheduling.k8s.io/v1beta1 PodGroup API (beta,
off by default in Kubernetes 1.37) and turns on the scheduler's GangScheduling plugin and the controller
manager's PodGroup protection, for ElasticJobs with ``spec.gangScheduling``."""


GO_TOOLS = Path(__file__).resolve().parents[3] / "scripts" / "go-tools"


def find_binaries() -> Path | None:
    """The folder of the control-plane binaries (``$PHALANX_K8S_BIN``, or the build of scripts/go-tools), or
    None when they were not built."""
    if env := os.environ.get("PHALANX_K8S_BIN"):
        return Path(env)
    result = subprocess.run([str(GO_TOOLS), "--cached"], capture_output=True, text=True, check=False)
    return Path(result.stdout.split()[-1]) if result.returncode == 0 else None


def go_tool(name: str) -> Path:
    """The path of one of scripts/go-tools' programs, built on first use (``make test`` builds them first)."""
    out = subprocess.run([str(GO_TOOLS), name], capture_output=True, text=True, check=True, timeout=3600)
    return Path(out.stdout.split()[-1])


def write_kubeconfig(
    path: Path, *, server: str, ca: Path, cert: Path | None = None, key: Path | None = None, token: str = ""
) -> Path:
    user: dict[str, str] = {}
    if cert and key:
        user = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        user = {"token": token}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "phalanx", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "phalanx", "context": {"cluster": "phalanx", "user": "user"}}],
        "current-context": "phalanx",
    }
    path.write_text(json.dumps(config, indent=2))  # JSON is valid YAML; kubectl and the client read it
    path.chmod(0o600)
    return path


RESOURCES = {
    # kubectl's name: (API group path, plural, namespaced)
    **dict.fromkeys(("ej", "elasticjob", "elasticjobs"), ("apis/phalanx.dev/v1alpha1", "elasticjobs", True)),
    **dict.fromkeys(("pod", "pods"), ("api/v1", "pods", True)),
    **dict.fromkeys(("event", "events"), ("api/v1", "events", True)),
    **dict.fromkeys(("configmap", "configmaps"), ("api/v1", "configmaps", True)),
    **dict.fromkeys(("secret", "secrets"), ("api/v1", "secrets", True)),
    **dict.fromkeys(("serviceaccount", "serviceaccounts"), ("api/v1", "serviceaccounts", True)),
    **dict.fromkeys(("node", "nodes"), ("api/v1", "nodes", False)),
    **dict.fromkeys(("lease", "leases"), ("apis/coordination.k8s.io/v1", "leases", True)),
    **dict.fromkeys(("podgroup", "podgroups"), ("apis/scheduling.k8s.io/v1beta1", "podgroups", True)),
    **dict.fromkeys(("crd", "crds"), ("apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False)),
}


def api_path(*args: str) -> str:
    """The API server's path for ``kubectl get ARGS`` (see ControlPlane.get); a pure function."""
    positional: list[str] = []
    namespace, subresource, query = "default", "", {}
    rest = iter(args)
    for arg in rest:
        if arg == "-n":
            namespace = next(rest)
        elif arg == "-l":
            query["labelSelector"] = next(rest)
        elif arg == "--field-selector":
            query["fieldSelector"] = next(rest)
        elif arg.startswith("--subresource="):
            subresource = arg.partition("=")[2]
        elif arg.startswith("-"):
            raise ValueError(f"kubectl flag {arg} is not read here")
        else:
            positional.append(arg)
    kind, *name = positional
    group, plural, namespaced = RESOURCES[kind]
    path = f"/{group}/" + (f"namespaces/{namespace}/" if namespaced else "") + plural
    path += "".join(f"/{part}" for part in [*name, subresource] if part)
    return path + (f"?{urllib.parse.urlencode(query)}" if query else "")


@dataclass
class ControlPlane:
    """A running control plane. ``kubeconfig`` is the admin's."""

    bin_dir: Path
    state_dir: Path
    bind_address: str = "127.0.0.1"
    """Where the API server listens. Loopback for the process kubelet; the container nodes' bridge address
    (k8s_harness/nodes.py) when Pods reach it through the ``kubernetes`` Service, as in a cluster."""
    node_monitor_grace_s: int = 50
    """How long a silent kubelet's Node stays Ready (the controller manager's default is 50 s)."""
    server: str = ""
    kubeconfig: Path = Path()
    ca: Path = Path()
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _admin_tls: ssl.SSLContext | None = None

    def get(self, *args: str) -> Any:
        """``kubectl get ARGS -o json`` read straight from the API server with the admin's certificate: the
        tests poll objects thousands of times a run, and each kubectl costs a process start, about 0.1 CPU-s.
        ARGS as kubectl takes them: a resource (the names in ``RESOURCES``), an optional name, ``-n NS``,
        ``-l SELECTOR``, ``--field-selector SELECTOR``, ``--subresource=scale``."""
        if self._admin_tls is None:
            self._admin_tls = ssl.create_default_context(cafile=str(self.ca))
            pki = self.state_dir / "pki"
            self._admin_tls.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        with urllib.request.urlopen(self.server + api_path(*args), context=self._admin_tls, timeout=30) as r:
            return json.load(r)

    def wait_established(self, crd: str, *, timeout_s: float = 90.0) -> None:
        """Polls the CRD's Established condition. ``kubectl wait`` gives up at once on a CRD whose status has
        no conditions yet, which a loaded API server takes a moment to write."""
        query = '{.status.conditions[?(@.type=="Established")].status}'
        deadline = time.monotonic() + timeout_s
        while self.kubectl("get", f"crd/{crd}", "-o", f"jsonpath={query}", check=False).strip() != "True":
            if time.monotonic() > deadline:
                raise TimeoutError(f"the CRD {crd} was not Established within {timeout_s:.0f} s")
            time.sleep(0.2)

    def kubectl(self, *args: str, input_text: str | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input_text.encode() if input_text is not None else None,
            capture_output=True,
            timeout=60,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.decode()}")
        return result.stdout.decode() + (result.stderr.decode() if not check else "")

    def _start(self, name: str, args: list[str]) -> None:
        with (self.state_dir / f"{name}.log").open("wb") as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                [str(self.bin_dir / name), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        (self.state_dir / f"{name}.pid").write_text(str(self.procs[name].pid))

    def start(self, *, timeout_s: float = 90.0) -> ControlPlane:
        d = self.state_dir
        pki = d / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        self.ca, _ = certs.make_ca(pki)
        serving = certs.serving_cert(pki, extra_ips=(self.bind_address,))
        admin = certs.client_cert(pki, name="admin", cn="phalanx-admin", org="system:masters")
        kcm = certs.client_cert(pki, name="kcm", cn="system:kube-controller-manager")
        sched = certs.client_cert(pki, name="scheduler", cn="system:kube-scheduler")
        # `kubectl logs/exec` go from the API server to a kubelet, which authenticates it by this certificate.
        to_kubelet = certs.client_cert(pki, name="kubelet-client", cn="kube-apiserver", org="system:masters")
        sa_key, sa_pub = certs.service_account_keys(pki)

        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        self._start(
            "etcd",
            [
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync=true",  # throwaway data: durability only costs time here
                "--log-level=warn",
            ],
        )
        self.server = f"https://{self.bind_address}:{api_port}"
        loopback = self.bind_address.startswith("127.")
        self._start(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={self.bind_address}",
                f"--advertise-address={self.bind_address}",
                f"--secure-port={api_port}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={self.ca}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                # Loopback is not a valid Endpoints address; a bridge address is, and Pods then reach the API
                # server through the `kubernetes` Service as in any cluster.
                f"--endpoint-reconciler-type={'none' if loopback else 'lease'}",
                f"--kubelet-client-certificate={to_kubelet.cert}",
                f"--kubelet-client-key={to_kubelet.key}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                "--enable-priority-and-fairness=false",  # one client mix, 2 cores: APF only adds work
                "--event-ttl=1h",
                # Gang scheduling (spec.gangScheduling): the PodGroup API, beta and off by default in 1.37.
                f"--feature-gates={GATES}",
                "--runtime-config=scheduling.k8s.io/v1beta1=true",
            ],
        )
        self.kubeconfig = write_kubeconfig(
            d / "admin.kubeconfig", server=self.server, ca=self.ca, cert=admin.cert, key=admin.key
        )
        kcm_cfg = write_kubeconfig(
            d / "kcm.kubeconfig", server=self.server, ca=self.ca, cert=kcm.cert, key=kcm.key
        )
        sched_cfg = write_kubeconfig(
            d / "scheduler.kubeconfig", server=self.server, ca=self.ca, cert=sched.cert, key=sched.key
        )
        self._wait_ready(admin, timeout_s=timeout_s)
        self._start(
            "kube-controller-manager",
            [
                f"--kubeconfig={kcm_cfg}",
                f"--authentication-kubeconfig={kcm_cfg}",
                f"--authorization-kubeconfig={kcm_cfg}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={self.ca}",
                # Only what the tests use: fewer controllers, less CPU on a small machine.
                "--controllers=garbage-collector-controller,serviceaccount-controller,"
                "serviceaccount-token-controller,root-ca-certificate-publisher-controller,"
                "namespace-controller,node-lifecycle-controller,taint-eviction-controller,"
                "endpointslice-controller,"
                "deployment-controller,replicaset-controller,"  # the e2e suite installs the Helm chart
                "persistentvolume-binder-controller,"  # and gives its jobs a shared volume
                "podgroup-protection-controller,"
                "clusterrole-aggregation-controller",  # the chart's roles for ElasticJob authors
                f"--node-monitor-grace-period={self.node_monitor_grace_s}s",
                f"--feature-gates={GATES}",
            ],
        )
        self._start(
            "kube-scheduler",
            [
                f"--kubeconfig={sched_cfg}",
                f"--authentication-kubeconfig={sched_cfg}",
                f"--authorization-kubeconfig={sched_cfg}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--leader-elect=false",
                f"--feature-gates={GATES}",
            ],
        )
        (d / "server").write_text(self.server)
        self._wait_default_service_account(timeout_s=timeout_s)
        return self

    def _wait_ready(self, admin: certs.ClientCert, *, timeout_s: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(admin.cert), str(admin.key))
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    tail = (self.state_dir / f"{name}.log").read_text()[-3000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", context=ctx, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError as exc:
                last = str(exc)
            time.sleep(0.3)
        raise RuntimeError(f"kube-apiserver not ready after {timeout_s}s: {last}")

    def _wait_default_service_account(self, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.kubectl("get", "serviceaccount", "default", "-n", "default", "-o", "name", check=False)
            if "serviceaccount/default" in out and "NotFound" not in out:
                return
            time.sleep(0.5)
        raise RuntimeError("the controller manager did not create the default ServiceAccount")

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def remove(self) -> None:
        shutil.rmtree(self.state_dir, ignore_errors=True)
