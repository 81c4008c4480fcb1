"""Real nodes for the test control plane: a kubelet per Node (built with the control plane by
scripts/go-tools), each with a containerd of its own and runc from Debian, Pods networked by the CNI
bridge plugin, Services routed by kube-proxy (iptables), names resolved by CoreDNS and the first node's Pods
guarded by NetworkPolicies (kube-router's firewall: :mod:`k8s_harness.netpol`), all on this machine.

What a node is here:

* **containerd**: root under ``~/.cache/phalanx/nodes/<node>`` (images stay imported between runs: the
  worker image is gigabytes), state, socket and CNI configuration under the run's state directory.
  ``restrict_oom_score_adj`` because these machines lack CAP_SYS_RESOURCE (runc would fail with "can't get
  final child's PID from pipe"), the cgroupfs driver (no systemd), and the sandbox image is the locally
  built pause image: nothing is ever pulled.
* **cgroups**: a root of its own in every v1 hierarchy (``/phalanx-<node>``); the kubelet, containerd and
  its shims run in ``/phalanx-<node>/system`` and Pods below ``/phalanx-<node>/kubepods``, so
  :meth:`ContainerNodes.power_off` kills a whole node, containers included, as a machine that dies.
* **network**: one bridge ``phx0`` (10.244.0.1/16) for every node; each node's Pods draw from a /24 of their
  own (host-local IPAM) and its kubelet listens on a node address on the bridge. The API server listens on
  the bridge address too, so Pods reach it through the ``kubernetes`` Service (10.0.0.1). kube-proxy runs
  once for the machine (the nodes share its kernel), CoreDNS once behind the ``kube-dns`` Service
  (10.0.0.10). Pod traffic never leaves the bridge: a FORWARD rule drops anything else.

One such cluster runs on a machine at a time (``/run/phalanx-nodes.lock``); a run killed before its clean-up
is cleaned up by the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from k8s_harness import certs, layers, netpol
from k8s_harness.controlplane import ControlPlane, free_port, go_tool, write_kubeconfig

BRIDGE = "phx0"
BRIDGE_IP = "10.244.0.1"
POD_CIDR = "10.244.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"  # the control plane's --service-cluster-ip-range
DNS_SERVICE_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
CNI_BIN = Path("/usr/lib/cni")
CGROUP = Path("/sys/fs/cgroup")
LOCK = Path("/run/phalanx-nodes.lock")
STATE_NOTE = Path("/run/phalanx-nodes.state")
"""Where the running cluster keeps its nodes' state: what a clean-up after a killed run unmounts."""
CACHE = Path(os.environ.get("PHALANX_NODES_CACHE", Path.home() / ".cache/phalanx/nodes"))
HOST_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip", "ipset")


def missing_host_tools() -> list[str]:
    """What this machine lacks to run container nodes (``scripts/host-packages`` installs it)."""
    missing = [t for t in HOST_TOOLS if shutil.which(t) is None]
    missing += [str(CNI_BIN / p) for p in ("bridge", "host-local", "loopback") if not (CNI_BIN / p).exists()]
    if os.geteuid() != 0:
        missing.append("root (a kubelet and containerd need it)")
    return missing


def _run(*argv: str, check: bool = True, timeout: float = 120, stdin: bytes | None = None) -> str:
    result = subprocess.run(argv, capture_output=True, timeout=timeout, check=False, input=stdin)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.decode()[-2000:]}")
    return result.stdout.decode()


def _hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies (cpu, memory, pids, ..., the named systemd one), not the v2 'unified'."""
    return [p for p in sorted(CGROUP.iterdir()) if (p / "cgroup.procs").exists() and p.name != "unified"]


def _make_cgroup(relative: str) -> None:
    for h in _hierarchies():
        path = h / relative.strip("/")
        path.mkdir(parents=True, exist_ok=True)
        if h.name == "cpuset":  # a new cpuset has no cpus or mems: copy its parent's, level by level
            for level in reversed([path, *path.parents]):
                if level == h or not str(level).startswith(str(h)):
                    continue
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    if not (level / knob).read_text().strip():
                        (level / knob).write_text((level.parent / knob).read_text())


def _cgroup_pids(relative: str) -> set[int]:
    pids: set[int] = set()
    for h in _hierarchies():
        root = h / relative.strip("/")
        if not root.exists():
            continue
        for procs in root.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids |= {int(x) for x in procs.read_text().split()}
    return pids


def _kill_cgroup(relative: str, *, timeout: float = 20) -> None:
    """SIGKILLs every process under a cgroup, in every hierarchy, until none is left (children forked
    meanwhile are caught by the next pass), then removes the cgroups."""
    deadline = time.monotonic() + timeout
    while pids := _cgroup_pids(relative):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of {relative} survived SIGKILL: {sorted(pids)}")
        time.sleep(0.1)
    for h in _hierarchies():
        root = h / relative.strip("/")
        if root.exists():
            for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()


def _unmount_under(*roots: Path) -> None:
    """Lazily unmounts what a killed node left mounted (rootfs overlays, volumes, netns files)."""
    prefixes = tuple(str(r) for r in roots)
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    for point in sorted((p for p in points if p.startswith(prefixes)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def _in_cgroup(relative: str, argv: list[str]) -> list[str]:
    """``argv`` run by a shell that first moves itself into the cgroup in every hierarchy, so the program
    and all it forks start there (a preexec_fn would do the same, but is unsafe in a threaded parent)."""
    procs = " ".join(f"'{h / relative.strip('/') / 'cgroup.procs'}'" for h in _hierarchies())
    return ["sh", "-c", f'for p in {procs}; do echo $$ > "$p"; done; exec "$@"', "sh", *argv]


@dataclass
class Node:
    name: str
    index: int
    state: Path
    ip: str
    pod_range: tuple[str, str]
    kubelet_port: int = 0
    containerd: subprocess.Popen[bytes] | None = None
    kubelet: subprocess.Popen[bytes] | None = None

    @property
    def cgroup(self) -> str:
        return f"/phalanx-{self.name}"

    @property
    def root(self) -> Path:
        return CACHE / self.name / "containerd"

    @property
    def socket(self) -> Path:
        return self.state / "containerd" / "containerd.sock"

    def ctr(self, *args: str, timeout: float = 900) -> str:
        return _run("ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args, timeout=timeout)


@dataclass
class ContainerNodes:
    """Container nodes joined to ``cp`` (started with ``bind_address=BRIDGE_IP``)."""

    cp: ControlPlane
    images: list[Path]
    """docker-archive tarballs imported into every node (the pause image among them)."""
    pause_image: str
    names: tuple[str, ...] = ("node-1", "node-2")
    nodes: list[Node] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    """Other names :meth:`tag` gave images (alias -> image), kept by a node that boots again."""
    _lock: IO[str] | None = None

    @property
    def state(self) -> Path:
        return self.cp.state_dir / "nodes"

    # --- the machine ----------------------------------------------------------------------------------
    @staticmethod
    def prepare_network() -> None:
        """The bridge the API server binds to; call before the control plane starts."""
        if _run("ip", "-o", "link", "show", BRIDGE, check=False) == "":
            _run("ip", "link", "add", BRIDGE, "type", "bridge")
        addresses = _run("ip", "-o", "-4", "addr", "show", "dev", BRIDGE)
        if f"{BRIDGE_IP}/16" not in addresses:
            _run("ip", "addr", "add", f"{BRIDGE_IP}/16", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # Service VIPs are routed to Pods by the host
        bridged = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if not bridged.exists():
            _run("modprobe", "br_netfilter", check=False)
        bridged.write_text("1")  # replies between Pods on the bridge see kube-proxy's NAT
        # Pods talk to Pods, Services and the API server; nothing they send is forwarded off the bridge.
        guard = ["FORWARD", "-s", POD_CIDR, "!", "-d", POD_CIDR, "-j", "DROP"]
        if subprocess.run(["iptables", "-C", *guard], capture_output=True, check=False).returncode != 0:
            _run("iptables", "-I", *guard)

    def _take_machine(self) -> None:
        """The machine's one cluster lock, then a clean-up of whatever a killed run left."""
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        self._lock = LOCK.open("w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another container-node cluster runs on this machine ({LOCK})") from None
        clean_machine(self.cp.bin_dir)
        STATE_NOTE.write_text(str(self.state))
        self.state.mkdir(parents=True, exist_ok=True)

    def _add_nodes(self) -> None:
        for i, name in enumerate(self.names):
            self.nodes.append(
                Node(
                    name=name,
                    index=i,
                    state=self.state / name,
                    ip=f"10.244.0.{2 + i}",
                    pod_range=(f"10.244.{1 + i}.2", f"10.244.{1 + i}.254"),
                )
            )

    def import_images(self, progress: Callable[[str], None] = lambda line: None) -> None:
        """Imports the images into every node's containerd root and stops there, starting no cluster: the
        part of a cold machine's first start that takes minutes (the worker image is gigabytes, unpacked by
        each node). `make test` runs it before pytest, so no test's timeout pays for it."""
        self._take_machine()
        try:
            self._add_nodes()
            for node in self.nodes:
                started = time.monotonic()
                self._make_node_dirs(node)
                self._prepare_images(node)
                progress(f"{node.name}: images ready in {time.monotonic() - started:.0f}s")
        finally:
            self.stop()

    def start(self) -> ContainerNodes:
        self._take_machine()
        self.prepare_network()
        self._cluster_dns()
        self._add_nodes()
        for node in self.nodes:
            self.start_node(node)
        self.wait_ready(self.names)
        # After the Nodes exist: kube-proxy reads its node's addresses at start and exits when they change.
        self._kube_proxy()
        self._network_policies()
        return self

    # --- cluster services -----------------------------------------------------------------------------
    def _identity(self, name: str, cn: str, org: str = "") -> Path:
        pki = self.cp.state_dir / "pki"
        cert = certs.client_cert(pki, name=name, cn=cn, org=org)
        return write_kubeconfig(
            self.state / f"{name}.kubeconfig",
            server=self.cp.server,
            ca=self.cp.ca,
            cert=cert.cert,
            key=cert.key,
        )

    def _spawn(self, key: str, argv: list[str], *, cgroup: str, env: dict[str, str] | None = None) -> None:
        _make_cgroup(cgroup)
        with (self.state / f"{key}.log").open("ab") as log:
            self.procs[key] = subprocess.Popen(
                _in_cgroup(cgroup, argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        (self.state / f"{key}.pid").write_text(str(self.procs[key].pid))

    def _cluster_dns(self) -> None:
        """CoreDNS on the bridge, reached as in any cluster through the kube-dns Service's address."""
        coredns = go_tool("coredns")
        kubeconfig = self._identity("coredns", "phalanx-coredns", "system:masters")
        corefile = self.state / "Corefile"
        corefile.write_text(
            f""".:53 {{
    bind {BRIDGE_IP}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} phalanx
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""
        )
        self._spawn("coredns", [str(coredns), "-conf", str(corefile)], cgroup="/phalanx-coredns")
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
            "spec": {
                "clusterIP": DNS_SERVICE_IP,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
                ],
            },
        }
        # CoreDNS runs on the machine, not in a Pod: its endpoints are written by hand, as for any
        # selector-less Service.
        slice_ = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-host",
                "namespace": "kube-system",
                "labels": {
                    "kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": "phalanx-test-harness",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [BRIDGE_IP], "conditions": {"ready": True}}],
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            ],
        }
        for obj in (service, slice_):
            self.cp.kubectl("apply", "-f", "-", input_text=json.dumps(obj))

    def _kube_proxy(self) -> None:
        kubeconfig = self._identity("kube-proxy", "system:kube-proxy")
        argv = [
            str(self.cp.bin_dir / "kube-proxy"),
            f"--kubeconfig={kubeconfig}",
            "--proxy-mode=iptables",
            f"--cluster-cidr={POD_CIDR}",
            "--masquerade-all",  # replies from a Pod to a Pod on the same bridge come back through the NAT
            f"--hostname-override={self.names[0]}",
            f"--healthz-bind-address=127.0.0.1:{free_port()}",
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            "--conntrack-max-per-core=0",  # leave the machine's conntrack table as it is
            "--iptables-sync-period=5s",
        ]
        self._spawn("kube-proxy", argv, cgroup="/phalanx-kube-proxy")

    def _network_policies(self) -> None:
        """NetworkPolicies enforced on the first node's Pods, from its first sync on."""
        kubeconfig = self._identity("kube-router", "phalanx-kube-router", "system:masters")
        argv = netpol.argv(
            go_tool("kube-router"),
            kubeconfig=kubeconfig,
            node=self.names[0],
            service_cidr=SERVICE_CIDR,
            health_port=free_port(),
        )
        self._spawn("kube-router", argv, cgroup="/phalanx-kube-router")
        deadline = time.monotonic() + 60
        while not netpol.enforcing():
            if self.procs["kube-router"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kube-router did not start enforcing:\n{self._tail('kube-router')}")
            time.sleep(0.2)

    # --- one node -------------------------------------------------------------------------------------
    @staticmethod
    def _make_node_dirs(node: Node) -> None:
        for d in (node.state, node.root, node.state / "containerd", node.state / "net.d"):
            d.mkdir(parents=True, exist_ok=True)
        _make_cgroup(f"{node.cgroup}/system")

    def start_node(self, node: Node) -> None:
        self._make_node_dirs(node)
        if f" {node.ip}/32 " not in _run("ip", "-o", "-4", "addr", "show", "dev", BRIDGE):
            _run("ip", "addr", "add", f"{node.ip}/32", "dev", BRIDGE)  # where its kubelet listens
        self._write_cni(node)
        self._prepare_images(node)
        node.containerd = self._containerd(node, cri=True)
        self._start_kubelet(node)

    def _start_kubelet(self, node: Node) -> None:
        node.kubelet_port = free_port()
        kubeconfig = self._identity(f"kubelet-{node.name}", f"system:node:{node.name}", "system:nodes")
        config = node.state / "kubelet.yaml"
        config.write_text(json.dumps(self._kubelet_config(node), indent=2))
        argv = [
            str(self.cp.bin_dir / "kubelet"),
            f"--config={config}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={node.state / 'kubelet'}",
            f"--cert-dir={node.state / 'pki'}",
            f"--hostname-override={node.name}",
            f"--node-ip={node.ip}",
            "--v=1",
        ]
        self._spawn(f"kubelet-{node.name}", argv, cgroup=f"{node.cgroup}/system")
        node.kubelet = self.procs[f"kubelet-{node.name}"]

    def _write_cni(self, node: Node) -> None:
        conf = {
            "cniVersion": "0.4.0",
            "name": f"phalanx-{node.name}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "hairpinMode": True,  # a Pod reaches itself through its own Service
                    "ipMasq": False,  # nothing leaves the machine
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(node.state / "ipam"),
                        "ranges": [
                            [
                                {
                                    "subnet": POD_CIDR,
                                    "rangeStart": node.pod_range[0],
                                    "rangeEnd": node.pod_range[1],
                                    "gateway": BRIDGE_IP,
                                }
                            ]
                        ],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (node.state / "net.d" / "10-phalanx.conflist").write_text(json.dumps(conf, indent=2))

    def _containerd_config(self, node: Node, *, cri: bool) -> Path:
        state = node.state / "containerd"
        cri_plugin = '"io.containerd.grpc.v1.cri"'
        text = f"""version = 2
root = "{node.root}"
state = "{state / "state"}"
disabled_plugins = [{cri_plugin if not cri else ""}]
[grpc]
  address = "{node.socket}"
[ttrpc]
  address = "{node.socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{state / "opt"}"
[plugins.{cri_plugin}]
  sandbox_image = "{self.pause_image}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  [plugins.{cri_plugin}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins.{cri_plugin}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.{cri_plugin}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins.{cri_plugin}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{node.state / "net.d"}"
"""
        path = state / ("config.toml" if cri else "config-images.toml")
        path.write_text(text)
        return path

    def _containerd(self, node: Node, *, cri: bool) -> subprocess.Popen[bytes]:
        key = f"containerd-{node.name}" + ("" if cri else "-images")
        node.socket.unlink(missing_ok=True)
        config = self._containerd_config(node, cri=cri)
        self._spawn(key, ["containerd", "--config", str(config)], cgroup=f"{node.cgroup}/system")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.procs[key].poll() is not None:
                raise RuntimeError(f"{key} exited: {self._tail(key)}")
            if node.socket.exists() and _run("ctr", "--address", str(node.socket), "version", check=False):
                return self.procs[key]
            time.sleep(0.2)
        raise RuntimeError(f"{key} did not answer: {self._tail(key)}")

    def _prepare_images(self, node: Node) -> None:
        """Imports the images into the node's own containerd (a no-op for layers it already has) and removes
        what an earlier run left, with the CRI plugin off so no kubelet state is in memory yet."""
        proc = self._containerd(node, cri=False)
        try:
            for container in node.ctr("containers", "list", "-q").split():
                with contextlib.suppress(RuntimeError):  # a task killed with its node is already gone
                    node.ctr("tasks", "delete", "-f", container, timeout=30)
                node.ctr("containers", "delete", container, timeout=60)
            have = set(node.ctr("images", "list", "-q").split())
            current: set[str] = set()
            for tarball in self.images:
                wanted = _archive_refs(tarball)
                current |= wanted
                if wanted and wanted <= have:
                    continue
                if self.nodes and node is not self.nodes[0]:
                    _share_blobs(self.nodes[0].root, node.root)
                _import(node, tarball, names=wanted)
            for alias, ref in self.aliases.items():  # a node that boots again still knows them
                if ref in current:
                    node.ctr("images", "tag", "--force", ref, alias, timeout=60)
                    current.add(alias)
            # Images of earlier builds (and names given to them) go, and with them their layers: only what
            # this run imported stays, or every source change would leave gigabytes behind.
            stale = sorted(set(node.ctr("images", "list", "-q").split()) - current)
            if stale:
                node.ctr("images", "remove", "--sync", *stale, timeout=300)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    def _kubelet_config(self, node: Node) -> dict[str, object]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": node.ip,
            "port": node.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.cp.ca)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{node.socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": node.cgroup,
            "failCgroupV1": False,  # these machines have cgroup v1
            "enforceNodeAllocatable": ["pods"],
            "clusterDNS": [DNS_SERVICE_IP],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(self._resolv_conf()),
            "podLogsDir": str(node.state / "pod-logs"),
            "failSwapOn": False,
            "oomScoreAdj": 0,  # lowering it needs CAP_SYS_RESOURCE, which these machines lack
            "protectKernelDefaults": False,
            # Nothing can be pulled here: no image may be collected, and disk pressure must not evict the
            # tests' Pods on a machine whose disk is shared with everything else.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
            },
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "5s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "0s",
            "shutdownGracePeriod": "0s",
            "localStorageCapacityIsolation": True,
        }

    def _resolv_conf(self) -> Path:
        """Upstream resolvers for Pods with dnsPolicy Default: none (nothing outside is reachable)."""
        path = self.state / "resolv.conf"
        path.write_text(f"nameserver {BRIDGE_IP}\n")
        return path

    def wait_ready(self, names: tuple[str, ...], *, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for key, proc in self.procs.items():
                if proc.poll() is not None and not key.endswith("-images"):
                    raise RuntimeError(f"{key} exited with {proc.returncode}: {self._tail(key)}")
            last = self.cp.kubectl("get", "nodes", "-o", "json", check=False)
            with contextlib.suppress(json.JSONDecodeError):
                items = json.loads(last[: last.rfind("}") + 1])["items"]
                ready = {
                    n["metadata"]["name"]
                    for n in items
                    if any(
                        c["type"] == "Ready" and c["status"] == "True"
                        for c in n["status"].get("conditions", [])
                    )
                }
                if set(names) <= ready:
                    return
            time.sleep(0.5)
        logs = "\n".join(self._tail(f"kubelet-{n}") for n in names)
        raise RuntimeError(f"nodes {names} not Ready after {timeout}s: {last[-1500:]}\n{logs}")

    def _tail(self, key: str, n: int = 3000) -> str:
        log = self.state / f"{key}.log"
        return f"--- {log}\n" + (log.read_text(errors="replace")[-n:] if log.exists() else "(no log)")

    # --- faults and teardown --------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def power_off(self, name: str) -> None:
        """The node's machine dies: its kubelet, containerd, shims and every container are SIGKILLed at once
        (no Pod is told), and what they mounted is released."""
        node = self.node(name)
        _kill_cgroup(node.cgroup)
        _unmount_under(node.state, node.root)
        self._reap(lambda key: key.endswith((f"-{name}", f"-{name}-images")))

    def tag(self, ref: str, alias: str) -> None:
        """Every node's runtime also knows image ``ref`` as ``alias``: what a team that built the image and
        pushed it to its own registry under that name has on its nodes."""
        self.aliases[_normalized(alias)] = _normalized(ref)
        for node in self.nodes:
            node.ctr("images", "tag", "--force", _normalized(ref), _normalized(alias), timeout=60)

    def stop_kubelet(self, name: str) -> None:
        """The node's kubelet dies and nothing else: its containers run on, unseen (its Node goes NotReady,
        its Pods are never confirmed stopped), as on a machine whose kubelet crashed or lost the API
        server."""
        kubelet = self.node(name).kubelet
        assert kubelet is not None, f"{name} has no kubelet"
        kubelet.kill()
        kubelet.wait(timeout=10)

    def start_kubelet(self, name: str) -> None:
        """A kubelet :meth:`stop_kubelet` killed starts again on the running node, which turns Ready."""
        node = self.node(name)
        self._start_kubelet(node)
        self.wait_ready((name,))

    def power_on(self, name: str) -> None:
        """A node that :meth:`power_off` killed boots again: its runtime drops the dead containers and its
        kubelet registers the same Node, empty."""
        self.start_node(self.node(name))
        self.wait_ready((name,))

    def _reap(self, killed: Callable[[str], bool] = lambda key: True) -> None:
        """Collects the exits of processes killed with their cgroup (they are this process' children)."""
        for key, proc in self.procs.items():
            if killed(key):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)

    def stop(self) -> None:
        clean_machine(self.cp.bin_dir)
        self._reap()
        self.nodes.clear()
        self.procs.clear()
        if self._lock is not None:
            self._lock.close()
            self._lock = None


KUBELET_CHAINS = (
    ("filter", "KUBE-FIREWALL", "INPUT"),
    ("filter", "KUBE-FIREWALL", "OUTPUT"),
    ("filter", "KUBE-KUBELET-CANARY", ""),
    ("nat", "KUBE-KUBELET-CANARY", ""),
    ("mangle", "KUBE-KUBELET-CANARY", ""),
)


def clean_machine(bin_dir: Path) -> None:
    """Removes every trace of container nodes from this machine, a run killed before its own clean-up
    included: their processes (each node's cgroup root, kube-proxy's, CoreDNS's), what they mounted, their
    Pods' network namespaces (nobody ran the CNI DEL of a Pod killed with its node), kube-proxy's and
    kube-router's rules and the kubelets' iptables chains. The bridge and its addresses stay; they are
    reused."""
    for h in _hierarchies():
        for stale in h.glob("phalanx-*"):
            _kill_cgroup("/" + stale.name)
    _unmount_under(CACHE, *([Path(STATE_NOTE.read_text())] if STATE_NOTE.exists() else []))
    STATE_NOTE.unlink(missing_ok=True)
    for name in _netns():
        if name.startswith("cni-") and not _run("ip", "netns", "pids", name, check=False).strip():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
    if (bin_dir / "kube-proxy").exists():
        subprocess.run(
            [str(bin_dir / "kube-proxy"), "--cleanup", "--proxy-mode=iptables"],
            capture_output=True,
            check=False,
            timeout=60,
        )
    netpol.remove_rules()
    for table, chain, parent in KUBELET_CHAINS:
        if parent:
            subprocess.run(
                ["iptables", "-t", table, "-D", parent, "-j", chain], capture_output=True, check=False
            )
        subprocess.run(["iptables", "-t", table, "-F", chain], capture_output=True, check=False)
        subprocess.run(["iptables", "-t", table, "-X", chain], capture_output=True, check=False)


def _netns() -> set[str]:
    return {line.split()[0] for line in _run("ip", "netns", "list", check=False).splitlines() if line.strip()}


def _share_blobs(source_root: Path, root: Path) -> None:
    """Hard-links the first node's image blobs into another node's content store. Blobs are immutable and
    named by their digest; containerd adopts a blob it finds on disk instead of keeping a second copy of what
    it imports, and the worker image is gigabytes."""
    source = source_root / "io.containerd.content.v1.content" / "blobs" / "sha256"
    target = root / "io.containerd.content.v1.content" / "blobs" / "sha256"
    if not source.is_dir():
        return
    target.mkdir(parents=True, exist_ok=True)
    for blob in source.iterdir():
        with contextlib.suppress(FileExistsError):
            os.link(blob, target / blob.name)


def _import(node: Node, tarball: Path, *, names: set[str]) -> None:
    """Imports a docker-archive into the node, sending only the layers it lacks when that is a small part of
    the image (k8s_harness/layers.py): after a source change, seconds instead of 90 s a node."""
    delta = node.state / "import-delta.tar"
    try:
        stored = set(node.ctr("content", "ls", "-q").split())
        if names and layers.write_delta(tarball, stored, delta, names=names):
            node.ctr("images", "import", str(delta))
            return
    finally:
        delta.unlink(missing_ok=True)
    node.ctr("images", "import", str(tarball))


def _archive_refs(tarball: Path) -> set[str]:
    """The image names a docker-archive tarball carries (its manifest.json's RepoTags), as containerd names
    them."""
    result = subprocess.run(
        ["tar", "-xOf", str(tarball), "manifest.json"], capture_output=True, check=False, timeout=60
    )
    if result.returncode != 0:
        return set()
    return {_normalized(tag) for entry in json.loads(result.stdout) for tag in entry.get("RepoTags") or []}


def _normalized(ref: str) -> str:
    """A reference as the CRI names it: ``phalanx:1`` is ``docker.io/library/phalanx:1``; ``localhost/x:1``
    and ``registry.example:5000/x:1`` name their registry already."""
    first, _, rest = ref.partition("/")
    if not rest:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"
