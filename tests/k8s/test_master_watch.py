"""The master follows its ElasticJob by a watch and coalesces its status patches (phalanx.master.store.kube),
on the real control plane, as the master's own service account with the Role the operator builds for it:

* the Role lets the master list and watch its own job (a field selector on its name) and nothing else;
* a suspend written to the spec reaches the master's sink within a second, with no GET and no PATCH;
* a watch the API server refuses as too old (410 Gone) is listed again, and a watch whose connection is cut
  (a real TCP proxy drops it) is resumed from its last resourceVersion, without a new LIST;
* progress publishes are coalesced (counted as the object's resourceVersion changes, seen by a separate
  watch), while an eviction goes out at once;
* one master holds the job's state at a time: a replacement's claim fences the old one, whose saves fail and
  whose process stops on its own within seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_harness.controlplane import ControlPlane, write_kubeconfig
from kubernetes import client, watch
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from tests.eventually import eventually
from tests.jobviews import job_view

from phalanx.api import views
from phalanx.api.elasticjob import GROUP, PLURAL, VERSION
from phalanx.api.errors import MasterFenced
from phalanx.master.serve.runtime import FENCE_CHECK_S
from phalanx.master.serve.server import FENCED_EXIT
from phalanx.master.store.kube import HOLDER_ANNOTATION, ConfigMapStateStore, ElasticJobStatusSink
from phalanx.operator import supporting

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

NS = "master-watch"
JOB = "watched"
OTHER = "neighbour"


def _job(name: str) -> dict[str, Any]:
    container = {"name": "trainer", "image": "x", "command": ["python", "train.py"]}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ElasticJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            # The master's side alone: the session's operator, when it runs, leaves the job to the test.
            "managedBy": "test.phalanx.dev/nobody",
            "nodes": {"min": 1, "max": 1},
            "template": {"spec": {"containers": [container]}},
        },
    }


def _admin(cp: ControlPlane) -> Any:
    return k8s_config.new_client_from_config(config_file=str(cp.kubeconfig))  # type: ignore[no-untyped-call]


def _master_kubeconfig(cp: ControlPlane, path: Path, *, server: str = "") -> Path:
    token = cp.kubectl("create", "token", f"{JOB}-master", "-n", NS, "--duration=1h").strip()
    return write_kubeconfig(path, server=server or cp.server, ca=cp.ca, token=token)


def _client(kubeconfig: Path) -> Any:
    return k8s_config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def master_api(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Two jobs; the master ServiceAccount, Role and RoleBinding of JOB as the operator builds them; a
    kubeconfig holding that ServiceAccount's token."""
    cp = control_plane
    cp.kubectl("create", "namespace", NS)
    for name in (JOB, OTHER):
        cp.kubectl("create", "-f", "-", input_text=json.dumps(_job(name)))
    job = json.loads(cp.kubectl("get", "elasticjob", JOB, "-n", NS, "-o", "json"))
    for obj in (
        supporting.master_service_account(job),
        supporting.master_role(job),
        supporting.master_role_binding(job),
    ):
        cp.kubectl(
            "create",
            "-f",
            "-",
            input_text=json.dumps({**obj, "metadata": {**obj["metadata"], "namespace": NS}}),
        )
    cp.kubectl("create", "configmap", f"{JOB}-master-state", "-n", NS)  # the operator makes it, empty
    yield _master_kubeconfig(cp, tmp_path_factory.mktemp("master") / "kubeconfig")
    cp.kubectl("delete", "namespace", NS, "--wait=false")


def _patch_spec(cp: ControlPlane, name: str, spec: dict[str, Any]) -> None:
    cp.kubectl("patch", "elasticjob", name, "-n", NS, "--type=merge", "-p", json.dumps({"spec": spec}))


def _watching(sink: ElasticJobStatusSink) -> bool:
    return sink.watch is not None and sink.watch.connected and sink.spec() is not None


def _start_master(master_api: Path, tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    """A real `phalanx master --state k8s://...` as the master's own ServiceAccount, logging to NAME.log."""
    (tmp_path / "token").write_text("watch-test-token-0123456789abcdef")
    env = {**os.environ, "KUBECONFIG": str(master_api), "PHALANX_LOG_LEVEL": "INFO"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = tmp_path / f"{name}.log"
    with log.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "master", "--job-id", JOB, "--nodes", "1:1", "--port", "0",
             "--http-port", "0", "--token-file", str(tmp_path / "token"), "--state", f"k8s://{NS}/{JOB}"],
            env=env, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    return process, log


# ------------------------------------------------------------------------------------------------------
# RBAC


def test_the_masters_role_lets_it_watch_its_own_job_and_no_other(master_api: Path) -> None:
    custom = client.CustomObjectsApi(_client(master_api))
    own = f"metadata.name={JOB}"
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, field_selector=own)
    assert [i["metadata"]["name"] for i in listed["items"]] == [JOB]
    events = watch.Watch().stream(  # type: ignore[no-untyped-call]
        custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        NS,
        PLURAL,
        field_selector=own,
        timeout_seconds=1,
    )
    assert [e["object"]["metadata"]["name"] for e in events] == [JOB]  # the initial ADDED, then the timeout
    refused: list[Callable[[], Any]] = [
        lambda: custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL),
        lambda: custom.list_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, field_selector=f"metadata.name={OTHER}"
        ),
        lambda: custom.list_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, watch=True, _preload_content=False
        ),
        lambda: custom.list_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            field_selector=f"metadata.name={OTHER}",
            watch=True,
            _preload_content=False,
        ),
        lambda: custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, field_selector=own),
        lambda: custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, OTHER),
        lambda: custom.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, JOB, {"spec": {"suspend": True}}
        ),
    ]
    for request in refused:
        with pytest.raises(ApiException) as refusal:
            request()
        assert refusal.value.status == 403


# ------------------------------------------------------------------------------------------------------
# Spec changes arrive by the watch


def test_a_suspend_reaches_the_master_within_a_second_without_a_read(
    control_plane: ControlPlane, master_api: Path
) -> None:
    sink = ElasticJobStatusSink(namespace=NS, name=JOB, api=_client(master_api))
    try:
        eventually(lambda: _watching(sink), timeout=10)
        gets, generation = sink.gets, sink.spec().generation  # type: ignore[union-attr]
        started = time.monotonic()
        _patch_spec(control_plane, JOB, {"suspend": True})
        eventually(lambda: sink.spec().suspend, timeout=2.0)  # type: ignore[union-attr]
        elapsed = time.monotonic() - started
        view = sink.spec()
        assert view is not None
        assert view.generation == generation + 1
        assert elapsed < 1.5, elapsed  # kubectl itself takes most of it
        assert (sink.gets, sink.patches) == (gets, 0)  # no read, no publish: the watch brought it
    finally:
        sink.close()
        _patch_spec(control_plane, JOB, {"suspend": False})


def test_a_running_master_acknowledges_a_suspend_within_a_second(
    control_plane: ControlPlane, master_api: Path, tmp_path: Path
) -> None:
    """A real `phalanx master --state k8s://...` as its own ServiceAccount, with no node: nothing changes
    in its status until the suspend arrives, so only its watch can bring it (the GET it made before came
    every 2 s). Its answer, phase Suspended for the new generation, is the operator's signal. Timed between
    the two versions of the job the API server reports (the spec change, the master's status patch)."""
    versions = VersionCounter(_admin(control_plane), JOB)
    master, log = _start_master(master_api, tmp_path, "master")

    def seen(since: int, check: Callable[[dict[str, Any]], bool]) -> float | None:
        """When the first version at or after index ``since`` that passes ``check`` arrived."""
        return next((at for at, obj in versions.objects[since:] if check(obj)), None)

    def master_says(phase: str, generation: int) -> Callable[[dict[str, Any]], bool]:
        def check(obj: dict[str, Any]) -> bool:
            m = (obj.get("status") or {}).get("master") or {}
            return m.get("phase") == phase and m.get("observedGeneration") == generation

        return check

    try:
        generation = int(
            control_plane.kubectl("get", "ej", JOB, "-n", NS, "-o", "jsonpath={.metadata.generation}")
        )
        eventually(lambda: seen(0, master_says("Pending", generation)), timeout=30, interval=0.1)
        # Its watch open: a change before that would come by its next GET, up to 2 s later.
        eventually(lambda: f"watching ElasticJob {NS}/{JOB}" in log.read_text(), timeout=30, interval=0.1)
        # Three changes, each acknowledged within a second: a GET every 2 s would make all three about one
        # time in eight.
        for suspend, phase in ((True, "Suspended"), (False, "Pending"), (True, "Suspended")):
            since = len(versions.objects)
            _patch_spec(control_plane, JOB, {"suspend": suspend})
            generation += 1
            eventually(
                lambda p=phase, g=generation, n=since: seen(n, master_says(p, g)), timeout=5, interval=0.05
            )
            changed = seen(since, lambda o, g=generation: o["metadata"]["generation"] == g)
            acknowledged = seen(since, master_says(phase, generation))
            assert changed is not None
            assert acknowledged is not None
            assert acknowledged - changed < 1.0, (phase, acknowledged - changed)
    finally:
        versions.stop()
        master.terminate()
        master.wait(timeout=30)
        _patch_spec(control_plane, JOB, {"suspend": False})
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def test_a_watch_the_api_server_no_longer_serves_is_listed_again(
    control_plane: ControlPlane, master_api: Path
) -> None:
    """Resumed from resourceVersion 1, long compacted out of the watch cache: the API server answers
    410 Gone, and the watch lists the job again and follows it from there."""
    sink = ElasticJobStatusSink(namespace=NS, name=JOB, api=_client(master_api), resume_from="1")
    try:
        w = sink.watch
        assert w is not None
        eventually(lambda: w.lists >= 1 and _watching(sink), timeout=10)
        assert w.gone >= 1
        _patch_spec(control_plane, JOB, {"suspend": True})
        eventually(lambda: sink.spec().suspend, timeout=2.0)  # type: ignore[union-attr]
    finally:
        sink.close()
        _patch_spec(control_plane, JOB, {"suspend": False})


class CuttableProxy:
    """A TCP proxy to the API server whose open connections the test can cut (both sides closed at once),
    as a network failure or an API server that drops its watches would."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            with self._lock:
                self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            conns, self.conns = self.conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_cut_watch_is_resumed_from_its_last_version(
    control_plane: ControlPlane, master_api: Path, tmp_path: Path
) -> None:
    host, _, port = control_plane.server.removeprefix("https://").rpartition(":")
    proxy = CuttableProxy((host, int(port)))
    kubeconfig = _master_kubeconfig(
        control_plane, tmp_path / "kubeconfig", server=f"https://127.0.0.1:{proxy.port}"
    )
    sink = ElasticJobStatusSink(namespace=NS, name=JOB, api=_client(kubeconfig))
    try:
        eventually(lambda: _watching(sink), timeout=10)
        w = sink.watch
        assert w is not None
        assert (w.lists, w.watches) == (1, 1)
        proxy.cut()
        eventually(lambda: w.failures >= 1, timeout=5)
        eventually(lambda: w.watches >= 2 and w.connected, timeout=5)  # after a backoff of about 0.5 s
        assert w.lists == 1, "resumed from its resourceVersion, not listed again"
        _patch_spec(control_plane, JOB, {"suspend": True})
        eventually(lambda: sink.spec().suspend, timeout=2.0)  # type: ignore[union-attr]
    finally:
        sink.close()
        proxy.close()
        _patch_spec(control_plane, JOB, {"suspend": False})


# ------------------------------------------------------------------------------------------------------
# Coalesced publishing


class VersionCounter:
    """Counts the versions of one job the API server reports (each accepted PATCH makes one), by a watch
    of the administrator's, independent of the sink under test."""

    def __init__(self, api: Any, name: str) -> None:
        self.objects: list[tuple[float, dict[str, Any]]] = []
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        custom = client.CustomObjectsApi(api)
        rv = custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)["metadata"][
            "resourceVersion"
        ]
        self._stream = self._watch.stream(
            custom.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL,
            field_selector=f"metadata.name={name}", resource_version=rv, timeout_seconds=60,
        )  # fmt: skip
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for event in self._stream:
                if event["type"] == "MODIFIED":
                    self.objects.append((time.monotonic(), event["raw_object"]))
        except Exception:  # stopped
            pass

    def stop(self) -> None:
        self._watch.stop()


def _status(step: int, **extra: Any) -> views.JobView:
    return job_view(phase="Running", round=1, world_size=2, members=["a", "b"], max_step=step, **extra)


def test_progress_is_coalesced_and_an_eviction_goes_out_at_once(
    control_plane: ControlPlane, master_api: Path
) -> None:
    interval = 1.5
    sink = ElasticJobStatusSink(namespace=NS, name=JOB, api=_client(master_api), progress_interval_s=interval)
    versions = VersionCounter(_admin(control_plane), JOB)
    try:
        eventually(lambda: _watching(sink), timeout=10)
        # No wait for the counter's watch to open: it resumes from the resourceVersion it read before the
        # first patch, so however late it opens it misses no version.
        window = 4.5
        start, step = time.monotonic(), 0
        while time.monotonic() - start < window:  # ten steps a second, as the master's publisher sees them
            step += 1
            sink.publish(_status(step))
            sink.spec()
            time.sleep(0.1)

        def last_step_published() -> bool:
            sink.spec()  # as the master's publisher does every half second: sends held-back progress when due
            return bool(versions.objects) and versions.objects[-1][1]["status"].get("step") == step

        eventually(last_step_published, timeout=interval + 1, interval=0.5)
        patches = len(versions.objects)
        # One at once (the first status), then one per interval: 4 or 5 for ~45 steps, never one per step.
        assert 2 <= patches <= window / interval + 2, [o["status"].get("step") for _, o in versions.objects]
        assert sink.patches == patches

        evicted = {
            "node_id": "b",
            "machine": "m",
            "reason": "no heartbeat",
            "kind": "heartbeat_timeout",
            "requested_at": time.time(),
        }
        sent = time.monotonic()
        sink.publish(_status(step + 1, evictions=[evicted]))  # within the interval of the last patch
        eventually(lambda: versions.objects[-1][1]["status"].get("evictions"), timeout=1.0, interval=0.01)
        assert versions.objects[-1][0] - sent < 0.5
        assert versions.objects[-1][1]["status"]["step"] == step + 1  # progress rides along
    finally:
        versions.stop()
        sink.close()


# ------------------------------------------------------------------------------------------------------
# Fencing: one master holds the job's state at a time


def test_a_master_that_another_took_over_from_cannot_write_the_state(
    control_plane: ControlPlane, master_api: Path
) -> None:
    """Two state stores as the master's own ServiceAccount: the second to load holds the state; the first
    is told so by every check and every save, and nothing it saves lands."""
    try:
        _two_holders(master_api)
    finally:  # the job's state as the operator made it, empty, for the masters started after this test
        control_plane.kubectl("patch", "configmap", f"{JOB}-master-state", "-n", NS, "--type=merge",
                              "-p", '{"data": null}')  # fmt: skip


def _two_holders(master_api: Path) -> None:
    old = ConfigMapStateStore(namespace=NS, name=JOB, api=_client(master_api), holder="old")
    new = ConfigMapStateStore(namespace=NS, name=JOB, api=_client(master_api), holder="new")
    old.load()
    old.save({"round": 1})
    assert old.holds()
    assert new.load() == {"round": 1}, "the replacement resumes from what the old one saved"
    assert new.holds()
    assert not old.holds()
    with pytest.raises(MasterFenced, match="master new took over"):
        old.save({"round": 99})
    new.save({"round": 2})
    assert new.load() == {"round": 2}
    cm = client.CoreV1Api(_client(master_api)).read_namespaced_config_map(f"{JOB}-master-state", NS)
    assert cm.metadata.annotations[HOLDER_ANNOTATION] == "new"


def test_a_replaced_master_process_stops_within_seconds_writing_nothing_more(
    master_api: Path, tmp_path: Path
) -> None:
    """Real `phalanx master` processes: the old one still runs when the new one starts (its node stopped
    answering, its process did not); it stops on its own within a few seconds of the new one's claim, with
    the fenced exit status, and the new one goes on holding the state."""
    old, old_log = _start_master(master_api, tmp_path, "old")
    new: subprocess.Popen[bytes] | None = None
    try:
        eventually(lambda: "holds the job's state as" in old_log.read_text(), timeout=30, interval=0.1)
        new, new_log = _start_master(master_api, tmp_path, "new")
        eventually(lambda: "holds the job's state as" in new_log.read_text(), timeout=30, interval=0.1)
        claimed = time.monotonic()
        assert old.wait(timeout=15) == FENCED_EXIT, old_log.read_text()[-3000:]
        assert time.monotonic() - claimed < 2 * FENCE_CHECK_S + 3, "stopped within a check or two"
        assert "another master took over the job's state" in old_log.read_text()
        assert "final save" not in old_log.read_text()
        time.sleep(2 * FENCE_CHECK_S)
        assert new.poll() is None, new_log.read_text()[-3000:]
        cm = client.CoreV1Api(_client(master_api)).read_namespaced_config_map(f"{JOB}-master-state", NS)
        holder = cm.metadata.annotations[HOLDER_ANNOTATION]
        assert f"holds the job's state as {holder}" in new_log.read_text()
    finally:
        for process in (old, new):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)


def test_a_master_whose_pod_was_deleted_is_fenced_by_its_revoked_credentials(
    control_plane: ControlPlane, master_api: Path, tmp_path: Path
) -> None:
    """A master's token is bound to its Pod: once the operator deletes the Pod (a master on a node that
    stopped answering), the API server refuses the token, and the master, which can then no longer read who
    holds the state, is told it was replaced."""
    cp = control_plane
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bound-master", "namespace": NS},
           "spec": {"nodeSelector": {"nowhere": "true"}, "containers": [{"name": "m", "image": "x"}],
                    "serviceAccountName": f"{JOB}-master"}}  # fmt: skip
    cp.kubectl("create", "-f", "-", input_text=json.dumps(pod))
    try:
        token = cp.kubectl("create", "token", f"{JOB}-master", "-n", NS, "--duration=1h",
                           "--bound-object-kind=Pod", "--bound-object-name=bound-master").strip()  # fmt: skip
        kubeconfig = write_kubeconfig(tmp_path / "bound", server=cp.server, ca=cp.ca, token=token)
        store = ConfigMapStateStore(namespace=NS, name=JOB, api=_client(kubeconfig), holder="bound")
        store.load()
        assert store.holds()
        cp.kubectl("delete", "pod", "bound-master", "-n", NS, "--grace-period=0", "--force")

        def refused() -> str:
            try:
                store.holds()
            except MasterFenced as exc:
                return str(exc)
            return ""

        said = eventually(refused, timeout=30, interval=0.5, what="the deleted Pod's token refused")
        assert "401 Unauthorized" in said
    finally:
        cp.kubectl("delete", "pod", "bound-master", "-n", NS, "--ignore-not-found", "--grace-period=0",
                   "--force", check=False)  # fmt: skip
        cp.kubectl("patch", "configmap", f"{JOB}-master-state", "-n", NS, "--type=merge",
                   "-p", '{"data": null}')  # fmt: skip
