"""A test kubelet: registers Nodes and runs the Pods the real kube-scheduler binds to them as local
processes. It replaces only the container runtime; scheduling, garbage collection, RBAC, service accounts
are the real Kubernetes components.

Run as its own process: ``python -m k8s_harness.kubelet --kubeconfig K --state-dir D --node n1 --node n2
[--simulated-node s1 ...]``.

* "Image": this checkout. A container's command runs with ``.venv/bin`` first on PATH, in its
  ``workingDir`` or else the checkout's root; the image name is ignored.
* Networking: every Pod gets a loopback address derived from its namespace/name (127.x.y.z; Linux routes
  all of 127.0.0.0/8 to lo), reported as ``status.podIP``. There is no cluster DNS and no kube-proxy:
  before starting a process, references to ``<svc>.<ns>.svc[.cluster.local]`` in its env and args are
  rewritten to the IP of a Pod the Service selects (the master Pod keeps its name, hence its IP, when it is
  recreated). ``KUBERNETES_SERVICE_HOST/PORT`` point at the API server.
* Volumes: secret, configMap, emptyDir, hostPath and projected service-account tokens (via TokenRequest)
  are materialised in the Pod's sandbox and bind-mounted at their mountPath inside a private mount
  namespace (``podexec.py``), so in-cluster config and token files work unchanged. A mount that would
  hide the checkout, its virtualenv or the sandbox is left out (see :func:`_hides_the_image`).
* Lifecycle: Running with container state on start; exit code -> Succeeded/Failed with the terminated
  state; deletion -> SIGTERM to the process group, SIGKILL after the grace period, then the Pod object is
  removed. Nodes renew their Lease every few seconds.
* Users: every "image" is this checkout as the project's Dockerfile builds it, which runs as ``USER
  10001:10001``; a container runs as that user unless its (or its Pod's) securityContext says
  ``runAsUser``/``runAsGroup``, with ``fsGroup`` and ``supplementalGroups`` as extra groups. Secret,
  configMap and projected files are root's with their ``defaultMode``/``mode`` (0644 by default); with an
  fsGroup they are re-owned to that group and made group-readable, emptyDirs group-writable, as the real
  kubelet's volume ownership does. So a file the image's user cannot read fails here as on a real cluster.
  The interpreter may live under a directory other users cannot enter (/root): ``podexec.py`` re-exposes
  it (and the checkout) inside the Pod's mount namespace before dropping root.
* Simulated nodes: Pods bound to them are marked Running (with an IP) without a process, for scale tests.
* Power: writing ``off`` to ``<state-dir>/power/<node>`` is that machine dying: its Pods' processes are
  SIGKILLed, nothing is reported, its Lease is no longer renewed (the node controller marks it NotReady as
  for a real lost node). ``on`` boots it again, empty: the Pods still bound to it are reported terminated
  (ContainerStatusUnknown, as a real kubelet does after a reboot) or removed if they were being deleted.
  The kubelet acknowledges by writing the state it applied to ``<node>.applied``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("test-kubelet")
ROOT = Path(__file__).resolve().parents[3]
PODEXEC = Path(__file__).with_name("podexec.py")
SIM_TAINT = "phalanx.dev/simulated"
IMAGE_USER = (10001, 10001)
"""uid and gid the Dockerfile's images run as (``USER 10001:10001``): every container's default user."""
DEFAULT_MODE = 0o644
"""Mode of secret, configMap and projected files without a defaultMode or mode, as in Kubernetes."""
RO_MASK, RW_MASK = 0o440, 0o660
"""Added by an fsGroup to the mode of read-only (secret, configMap, projected) or writable volumes' files."""
_SVC = re.compile(
    r"\b([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\.([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\.svc(?:\.cluster\.local)?\b"
)
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def pod_ip(namespace: str, name: str) -> str:
    """A stable loopback address per Pod (never in 127.0.0.0/16, where other services live)."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
    return f"127.{1 + digest[0] % 254}.{digest[1]}.{1 + digest[2] % 254}"


def now_rfc3339() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hides_the_image(target: Path, sandbox: Path) -> bool:
    """Whether a mount at ``target`` would hide this checkout (the "image"), its virtualenv or the Pod's
    sandbox, e.g. an emptyDir at /tmp when the checkout lives under /tmp. A container's volumes never hide
    its image, so such a mount is left out; the Pod writes to the real directory instead."""
    target = target.resolve()
    protected = (ROOT, Path(sys.prefix).resolve(), sandbox.resolve())
    return any(p == target or target in p.parents for p in protected)


@dataclass
class Running:
    proc: subprocess.Popen[bytes] | None
    uid: str
    started_at: str
    node: str
    kill_at: float | None = None
    done: bool = False


@dataclass
class Kubelet:
    core: Any
    coord: Any
    nodes: list[str]
    simulated: list[str]
    state_dir: Path
    api_host: str
    api_port: str
    pods: dict[tuple[str, str], Running] = field(default_factory=dict)
    powered_off: set[str] = field(default_factory=set)
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    stop: threading.Event = field(default_factory=threading.Event)

    # --- nodes -------------------------------------------------------------------------------------
    def register_nodes(self) -> None:
        for name in [n for n in [*self.nodes, *self.simulated] if n not in self.powered_off]:
            sim = name in self.simulated
            body = {
                "metadata": {
                    "name": name,
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "phalanx.dev/test-kubelet": "simulated" if sim else "process",
                    },
                },
                # Simulated nodes take only Pods that ask for them (scale tests): nothing runs there.
                "spec": {"taints": [{"key": SIM_TAINT, "value": "true", "effect": "NoSchedule"}]}
                if sim
                else {},
            }
            with contextlib.suppress(ApiException):
                self.core.create_node(body)
            self.core.patch_node_status(name, {"status": self._node_status(sim)})

    def _node_status(self, sim: bool) -> dict[str, Any]:
        now = now_rfc3339()
        capacity = {"cpu": "64", "memory": "256Gi", "pods": "250" if sim else "110"}
        return {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "test kubelet is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.37.1-phalanx-test",
                "containerRuntimeVersion": "phalanx-test://process",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": "",
                "osImage": "",
                "kubeProxyVersion": "",
            },
        }

    def renew_leases(self) -> None:
        for name in [n for n in [*self.nodes, *self.simulated] if n not in self.powered_off]:
            body = {
                "metadata": {"name": name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": _micro_now()},
            }
            try:
                self.coord.patch_namespaced_lease(name, "kube-node-lease", body)
            except ApiException as exc:
                if exc.status == 404:
                    with contextlib.suppress(ApiException):
                        self.coord.create_namespaced_lease("kube-node-lease", body)

    # --- pods --------------------------------------------------------------------------------------
    def watch_pods(self) -> None:
        mine = set(self.nodes) | set(self.simulated)
        while not self.stop.is_set():
            try:
                listing = self.core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=")
                for pod in listing.items:
                    if pod.spec.node_name in mine:
                        self.events.put({"type": "SYNC", "object": pod})
                w = watch.Watch()
                for ev in w.stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector="spec.nodeName!=",
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=60,
                ):
                    if self.stop.is_set():
                        w.stop()
                        break
                    if ev["object"].spec.node_name in mine:
                        self.events.put(ev)
            except Exception as exc:  # a lost watch is re-established from a fresh list
                log.warning("pod watch restarted: %s", exc)
                time.sleep(0.5)

    def handle(self, ev: dict[str, Any]) -> None:
        pod = ev["object"]
        if pod.spec.node_name in self.powered_off:
            return  # a dead machine hears nothing
        key = (pod.metadata.namespace, pod.metadata.name)
        if ev["type"] == "DELETED":
            self._kill_now(key)
            return
        current = self.pods.get(key)
        if current is not None and current.uid != pod.metadata.uid:
            self._kill_now(key)  # an older Pod of the same name is gone; this is a new one
            current = None
        if pod.metadata.deletion_timestamp is not None:
            self._terminate(pod, current)
            return
        if current is None and (pod.status.phase in (None, "Pending")):
            self._start(pod)

    def _start(self, pod: Any) -> None:
        ns, name = pod.metadata.namespace, pod.metadata.name
        key = (ns, name)
        ip = pod_ip(ns, name)
        started = now_rfc3339()
        container = pod.spec.containers[0]
        proc = None
        if pod.spec.node_name not in self.simulated:
            try:
                proc = self._launch(pod, ip)
            except Exception as exc:
                log.exception("cannot start %s/%s", ns, name)
                self.pods[key] = Running(
                    proc=None, uid=pod.metadata.uid, started_at=started, node=pod.spec.node_name, done=True
                )
                self._patch_status(pod, self._terminated_status(pod, 128, "StartError", started, str(exc)))
                return
        self.pods[key] = Running(proc=proc, uid=pod.metadata.uid, started_at=started, node=pod.spec.node_name)
        status = {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "startTime": started,
            "conditions": _conditions(ready=True),
            "containerStatuses": [
                {
                    "name": container.name,
                    "image": container.image or "",
                    "imageID": "",
                    "ready": True,
                    "started": True,
                    "restartCount": 0,
                    "containerID": f"process://{proc.pid if proc else 0}",
                    "state": {"running": {"startedAt": started}},
                }
            ],
        }
        self._patch_status(pod, status)

    def _terminated_status(
        self, pod: Any, code: int, reason: str, started: str, message: str = ""
    ) -> dict[str, Any]:
        container = pod.spec.containers[0]
        term = {"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now_rfc3339()}
        if message:
            term["message"] = message[-2000:]
        return {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": _conditions(ready=False),
            "containerStatuses": [
                {
                    "name": container.name,
                    "image": container.image or "",
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 0,
                    "state": {"terminated": term},
                }
            ],
        }

    def _patch_status(self, pod: Any, status: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(
                pod.metadata.name, pod.metadata.namespace, {"status": status}
            )
        except ApiException as exc:
            log.warning("status of %s/%s: %s", pod.metadata.namespace, pod.metadata.name, exc.reason)

    def _terminate(self, pod: Any, current: Running | None) -> None:
        grace = pod.metadata.deletion_grace_period_seconds or 0
        if current is None or current.proc is None or current.done:
            self._remove(pod)
            return
        if current.kill_at is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(current.proc.pid, signal.SIGTERM)
            current.kill_at = time.monotonic() + grace
        elif grace == 0:
            current.kill_at = time.monotonic()

    def _remove(self, pod: Any) -> None:
        key = (pod.metadata.namespace, pod.metadata.name)
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(
                pod.metadata.name,
                pod.metadata.namespace,
                grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0, preconditions={"uid": pod.metadata.uid}),
            )
        self.pods.pop(key, None)
        shutil.rmtree(_pod_tmp(pod.metadata.uid), ignore_errors=True)

    def _kill_now(self, key: tuple[str, str]) -> None:
        current = self.pods.pop(key, None)
        if current and current.proc and current.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(current.proc.pid, signal.SIGKILL)
            current.proc.wait()
        if current:
            shutil.rmtree(_pod_tmp(current.uid), ignore_errors=True)  # the container's /tmp goes with it

    def reap(self) -> None:
        """Reports exited processes and enforces deletion grace periods."""
        for key, cur in list(self.pods.items()):
            if cur.proc is None or cur.done:
                continue
            code = cur.proc.poll()
            if code is None:
                if cur.kill_at is not None and time.monotonic() >= cur.kill_at:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(cur.proc.pid, signal.SIGKILL)
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cur.proc.pid, signal.SIGKILL)  # leftovers of the Pod's process group
            cur.done = True
            exit_code = code if code >= 0 else 128 - code
            try:
                pod = self.core.read_namespaced_pod(key[1], key[0])
            except ApiException:
                self.pods.pop(key, None)
                shutil.rmtree(_pod_tmp(cur.uid), ignore_errors=True)
                continue
            if pod.metadata.uid != cur.uid:
                continue
            reason = "Completed" if exit_code == 0 else "Error"
            log_tail = ""
            with contextlib.suppress(OSError):
                log_tail = (self._sandbox(pod) / "container.log").read_text(errors="replace")[-1500:]
            self._patch_status(pod, self._terminated_status(pod, exit_code, reason, cur.started_at, log_tail))
            if pod.metadata.deletion_timestamp is not None:
                self._remove(pod)

    # --- process launch ----------------------------------------------------------------------------
    def _sandbox(self, pod: Any) -> Path:
        return (
            self.state_dir / "pods" / f"{pod.metadata.namespace}_{pod.metadata.name}_{pod.metadata.uid[:8]}"
        )

    def _launch(self, pod: Any, ip: str) -> subprocess.Popen[bytes]:
        ns = pod.metadata.namespace
        sandbox = self._sandbox(pod)
        sandbox.mkdir(parents=True, exist_ok=True)
        container = pod.spec.containers[0]
        # A container's /tmp is its own, and so are the sockets its processes make there. Under /tmp itself:
        # the Pod's user must reach it (the state directory is root's, 0700), and a socket's path must fit in
        # 108 bytes.
        tmp = _pod_tmp(pod.metadata.uid)
        tmp.mkdir(mode=0o700, exist_ok=True)
        env: dict[str, str] = {
            "PATH": f"{ROOT / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(sandbox),
            "TMPDIR": str(tmp),
            "HOSTNAME": pod.metadata.name,
            "KUBERNETES_SERVICE_HOST": self.api_host,
            "KUBERNETES_SERVICE_PORT": self.api_port,
            "PYTHONUNBUFFERED": "1",
        }
        for var in container.env or []:
            env[var.name] = self._env_value(pod, var, env, ip)
        env = {k: self._rewrite_services(ns, v) for k, v in env.items()}
        argv = [_expand(a, env) for a in [*(container.command or []), *(container.args or [])]]
        argv = [self._rewrite_services(ns, a) for a in argv]
        if not argv:
            raise RuntimeError("the test kubelet needs an explicit command (there is no image entrypoint)")
        uid, gid, groups = _identity(pod, container)
        mounts = self._volumes(pod, sandbox, fs_group=_fs_group(pod))
        os.chown(sandbox, uid, gid)  # the container's HOME, as the image's home directory is its user's
        os.chown(tmp, uid, gid)
        spec = {
            "mounts": mounts,
            "argv": argv,
            "env": env,
            "cwd": container.working_dir or str(ROOT),
            "user": {"uid": uid, "gid": gid, "groups": groups},
            "expose": [sys.base_prefix, str(ROOT)],
        }
        spec_file = sandbox / "podexec.json"
        spec_file.write_text(json.dumps(spec))
        (sandbox / "pod-ip").write_text(ip)
        with (sandbox / "container.log").open("ab") as out:
            proc = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "--",
                    sys.executable,
                    str(PODEXEC),
                    str(spec_file),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (sandbox / "pid").write_text(str(proc.pid))
        log.info("started %s/%s as pid %d at %s: %s", ns, pod.metadata.name, proc.pid, ip, argv[:3])
        return proc

    def _env_value(self, pod: Any, var: Any, env: dict[str, str], ip: str) -> str:
        if var.value is not None:
            return _expand(var.value, env)
        src = var.value_from
        if src is None:
            return ""
        if src.field_ref is not None:
            path = src.field_ref.field_path
            fields = {
                "metadata.name": pod.metadata.name,
                "metadata.namespace": pod.metadata.namespace,
                "metadata.uid": pod.metadata.uid,
                "spec.nodeName": pod.spec.node_name,
                "spec.serviceAccountName": pod.spec.service_account_name or "",
                "status.podIP": ip,
                "status.hostIP": "127.0.0.1",
            }
            if path in fields:
                return str(fields[path])
            match = re.match(r"metadata\.(labels|annotations)\['(.+)'\]", path)
            if match:
                values = getattr(pod.metadata, match[1]) or {}
                return str(values.get(match[2], ""))
            return ""
        if src.secret_key_ref is not None:
            ref = src.secret_key_ref
            secret = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace)
            return base64.b64decode((secret.data or {})[ref.key]).decode()
        if src.config_map_key_ref is not None:
            ref = src.config_map_key_ref
            cm = self.core.read_namespaced_config_map(ref.name, pod.metadata.namespace)
            return str((cm.data or {})[ref.key])
        return ""

    def _rewrite_services(self, namespace: str, text: str) -> str:
        def resolve(match: re.Match[str]) -> str:
            svc_name, svc_ns = match[1], match[2]
            try:
                svc = self.core.read_namespaced_service(svc_name, svc_ns)
            except ApiException:
                return match[0]
            selector = svc.spec.selector or {}
            if not selector:
                return match[0]
            sel = ",".join(f"{k}={v}" for k, v in selector.items())
            pods = self.core.list_namespaced_pod(svc_ns, label_selector=sel).items
            if not pods:
                return match[0]
            pods.sort(key=lambda p: (p.status.phase != "Running", p.metadata.name))
            return pod_ip(svc_ns, pods[0].metadata.name)

        return _SVC.sub(resolve, text)

    def _volumes(self, pod: Any, sandbox: Path, *, fs_group: int | None) -> list[list[Any]]:
        ns = pod.metadata.namespace
        vol_dirs: dict[str, Path] = {}
        for vol in pod.spec.volumes or []:
            d = sandbox / "volumes" / vol.name
            d.mkdir(parents=True, exist_ok=True)
            read_only = True
            if vol.secret is not None:
                secret = self.core.read_namespaced_secret(vol.secret.secret_name, ns)
                data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
                _write_items(d, data, vol.secret.items, vol.secret.default_mode)
            elif vol.config_map is not None:
                cm = self.core.read_namespaced_config_map(vol.config_map.name, ns)
                data = {k: v.encode() for k, v in (cm.data or {}).items()}
                _write_items(d, data, vol.config_map.items, vol.config_map.default_mode)
            elif vol.host_path is not None:
                vol_dirs[vol.name] = Path(vol.host_path.path)
                continue
            elif vol.projected is not None:
                self._projected(pod, vol.projected, d)
            else:  # emptyDir: writable by anyone, as Kubernetes makes it
                d.chmod(0o777)
                read_only = False
            if fs_group is not None:
                _own_by_group(d, fs_group, mask=RO_MASK if read_only else RW_MASK)
            vol_dirs[vol.name] = d
        mounts: list[list[Any]] = []
        container = pod.spec.containers[0]
        for m in container.volume_mounts or []:
            source = vol_dirs.get(m.name)
            if source is None or _hides_the_image(Path(m.mount_path), sandbox):
                continue
            if m.sub_path:
                source = source / m.sub_path
            mounts.append([str(source), m.mount_path, bool(m.read_only)])
        return mounts

    def _projected(self, pod: Any, projected: Any, d: Path) -> None:
        ns = pod.metadata.namespace
        default = projected.default_mode
        for source in projected.sources or []:
            if source.service_account_token is not None:
                req = client.AuthenticationV1TokenRequest(
                    spec=client.V1TokenRequestSpec(
                        audiences=[],
                        expiration_seconds=source.service_account_token.expiration_seconds or 3600,
                        bound_object_ref=client.V1BoundObjectReference(
                            kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid
                        ),
                    )
                )
                sa = pod.spec.service_account_name or "default"
                token = self.core.create_namespaced_service_account_token(sa, ns, req)
                _write(d / source.service_account_token.path, token.status.token.encode(), default)
            elif source.config_map is not None:
                cm = self.core.read_namespaced_config_map(source.config_map.name, ns)
                data = {k: v.encode() for k, v in (cm.data or {}).items()}
                _write_items(d, data, source.config_map.items, default)
            elif source.secret is not None:
                secret = self.core.read_namespaced_secret(source.secret.name, ns)
                data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
                _write_items(d, data, source.secret.items, default)
            elif source.downward_api is not None:
                for item in source.downward_api.items or []:
                    if item.field_ref and item.field_ref.field_path == "metadata.namespace":
                        _write(d / item.path, ns.encode(), item.mode or default)
                    elif item.field_ref and item.field_ref.field_path == "metadata.name":
                        _write(d / item.path, pod.metadata.name.encode(), item.mode or default)

    # --- power -------------------------------------------------------------------------------------
    def apply_power(self) -> None:
        """Applies what ``<state-dir>/power/<node>`` asks (see the module's docstring)."""
        power = self.state_dir / "power"
        for request in power.glob("*") if power.is_dir() else []:
            node, wanted = request.name, request.read_text().strip()
            if request.suffix or node not in self.nodes:
                continue
            if (wanted == "off") != (node in self.powered_off):
                self.power_off(node) if wanted == "off" else self.power_on(node)
            (power / f"{node}.applied").write_text(wanted)

    def power_off(self, node: str) -> None:
        self.powered_off.add(node)
        for key, cur in list(self.pods.items()):
            if cur.node == node:
                self._kill_now(key)
        log.info("node %s powered off", node)

    def power_on(self, node: str) -> None:
        self.powered_off.discard(node)
        self.register_nodes()
        self.renew_leases()
        for pod in self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items:
            if pod.metadata.deletion_timestamp is not None:
                self._remove(pod)
            elif pod.status.phase in ("Pending", "Running"):
                started = pod.status.start_time.isoformat() if pod.status.start_time else now_rfc3339()
                message = "The container could not be located when the pod was terminated"
                self._patch_status(
                    pod, self._terminated_status(pod, 137, "ContainerStatusUnknown", started, message)
                )
        log.info("node %s powered on", node)

    # --- main loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        self.register_nodes()
        self.renew_leases()
        threading.Thread(target=self.watch_pods, daemon=True).start()
        next_lease = time.monotonic() + 5
        while not self.stop.is_set():
            try:
                ev = self.events.get(timeout=0.2)
                self.handle(ev)
                while True:
                    self.handle(self.events.get_nowait())
            except queue.Empty:
                pass
            except Exception:
                log.exception("event handling failed")
            self.reap()
            try:
                self.apply_power()
            except Exception:
                log.exception("power request failed")
            if time.monotonic() >= next_lease:
                next_lease = time.monotonic() + 5
                try:
                    self.renew_leases()
                except Exception as exc:
                    log.warning("lease renewal failed: %s", exc)
        for key in list(self.pods):
            self._kill_now(key)


def _pod_tmp(uid: str) -> Path:
    """A Pod's own /tmp (its processes' TMPDIR), by the Pod's uid."""
    return Path(tempfile.gettempdir()) / f"phalanx-pod-{uid[:8]}"


def _expand(text: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m[1], m[0]), text)


def _write(path: Path, data: bytes, mode: int | None) -> None:
    """A volume file, root's (the kubelet's), with its Kubernetes mode (0644 unless the spec says)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(DEFAULT_MODE if mode is None else mode)


def _write_items(d: Path, data: dict[str, bytes], items: list[Any] | None, default_mode: int | None) -> None:
    """A Secret's or ConfigMap's keys as files: all of them, or the listed ``items`` (key -> path, mode)."""
    if items:
        for item in items:
            _write(d / item.path, data.get(item.key, b""), item.mode or default_mode)
    else:
        for key, value in data.items():
            _write(d / key, value, default_mode)


def _own_by_group(root: Path, gid: int, *, mask: int) -> None:
    """The real kubelet's volume ownership for an fsGroup: every file and directory goes to that group and
    gets ``mask`` (directories also setgid and group-searchable)."""
    for path in [root, *root.rglob("*")]:
        os.lchown(path, -1, gid)
        mode = path.stat().st_mode & 0o7777
        if path.is_dir():
            path.chmod(mode | mask | stat.S_ISGID | 0o110)
        else:
            path.chmod(mode | mask)


def _security(pod: Any, container: Any, field: str) -> Any:
    """A securityContext field: the container's, else the Pod's (None if neither sets it)."""
    value = getattr(container.security_context, field, None) if container.security_context else None
    if value is None and pod.spec.security_context is not None:
        value = getattr(pod.spec.security_context, field, None)
    return value


def _fs_group(pod: Any) -> int | None:
    return pod.spec.security_context.fs_group if pod.spec.security_context else None


def _identity(pod: Any, container: Any) -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary groups) the container runs as: its securityContext's, else the image's."""
    uid = _security(pod, container, "run_as_user")
    gid = _security(pod, container, "run_as_group")
    groups = list(pod.spec.security_context.supplemental_groups or []) if pod.spec.security_context else []
    if (fs_group := _fs_group(pod)) is not None:
        groups.append(fs_group)
    return (IMAGE_USER[0] if uid is None else uid), (IMAGE_USER[1] if gid is None else gid), groups


def _micro_now() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _conditions(*, ready: bool) -> list[dict[str, Any]]:
    now = now_rfc3339()
    value = "True" if ready else "False"
    return [
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": value, "lastTransitionTime": now},
        {"type": "Ready", "status": value, "lastTransitionTime": now},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--node", action="append", default=[])
    parser.add_argument("--simulated-node", action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config.load_kube_config(args.kubeconfig)
    api = client.ApiClient()
    server = api.configuration.host.removeprefix("https://")
    host, _, port = server.partition(":")
    kubelet = Kubelet(
        core=client.CoreV1Api(api),
        coord=client.CoordinationV1Api(api),
        nodes=args.node,
        simulated=args.simulated_node,
        state_dir=Path(args.state_dir),
        api_host=host,
        api_port=port or "443",
    )
    signal.signal(signal.SIGTERM, lambda *_: kubelet.stop.set())
    kubelet.run()


if __name__ == "__main__":
    main()
