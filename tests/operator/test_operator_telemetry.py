"""The operator's /healthz and /metrics server (phalanx.operator.telemetry), over real HTTP on loopback, and
the executor's bookkeeping of passes, actions and phases behind it."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from phalanx.api.settings import OperatorSettings
from phalanx.operator import executor as executor_module
from phalanx.operator.actions import DeleteJob, Event, Observed, PatchStatus
from phalanx.operator.executor import Executor
from phalanx.operator.telemetry import OperatorMetrics, loop_answers, serve

TOKEN = "operator-metrics-token-0123456789"


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread, as the operator's asyncio loop runs beside the server's thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _server(metrics: OperatorMetrics, healthy: Any, token: str = TOKEN) -> str:
    server = serve(port=0, metrics=metrics, healthy=healthy, token=token, host="127.0.0.1")
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_healthz_says_whether_the_event_loop_answers(loop: asyncio.AbstractEventLoop) -> None:
    url = _server(OperatorMetrics(), lambda: loop_answers(loop, timeout_s=1))
    assert httpx.get(f"{url}/healthz").status_code == 200
    blocked = threading.Event()
    loop.call_soon_threadsafe(blocked.wait, 10)  # a handler that never yields: the loop is wedged
    try:
        response = httpx.get(f"{url}/healthz", timeout=5)
        assert response.status_code == 503
        assert "does not answer" in response.text
    finally:
        blocked.set()
    assert httpx.get(f"{url}/healthz").status_code == 200, "answers again once the loop runs"
    loop.call_soon_threadsafe(loop.stop)
    threading.Event().wait(0.2)
    assert httpx.get(f"{url}/healthz").status_code == 503, "a stopped loop is not healthy"


def test_metrics_need_the_token_and_count_passes_actions_and_phases() -> None:
    metrics = OperatorMetrics()
    url = _server(metrics, lambda: True)
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    metrics.passes.labels(result="ok").inc()
    metrics.job_phase("ml", "gpt", "Running")
    metrics.job_phase("ml", "bert", "Running")
    metrics.job_phase("ml", "old", "Failed")
    metrics.job_phase("ml", "old", None)  # deleted
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'phalanx_operator_reconcile_passes_total{result="ok"} 1.0' in text
    assert 'phalanx_operator_jobs{phase="Running"} 2.0' in text
    assert 'phalanx_operator_jobs{phase="Failed"} 0.0' in text
    assert "gpt" not in text, "no job names in labels"
    assert httpx.get(f"{url}/nothing").status_code == 404


def test_without_a_metrics_token_there_is_no_metrics_endpoint() -> None:
    url = _server(OperatorMetrics(), lambda: True, token="")
    assert httpx.get(f"{url}/metrics").status_code == 404
    assert httpx.get(f"{url}/healthz").status_code == 200


class _Refusing:
    """The custom-objects API, refusing every write (the executor's only dependency in ``apply`` here)."""

    def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> None:
        raise ApiException(status=403, reason="Forbidden")

    def delete_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> None:
        raise ApiException(status=403, reason="Forbidden")


class _Events:
    def create_namespaced_event(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_the_executor_counts_its_passes_actions_failures_and_the_jobs_phase(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    executor = Executor(api=client.ApiClient(), settings=OperatorSettings())
    executor.custom, executor.core = _Refusing(), _Events()
    job = {"metadata": {"name": "j", "namespace": "ns", "uid": "u"}, "spec": {}, "status": {}}
    actions = [PatchStatus({"phase": "Running"}), Event("Normal", "Running", "x"), DeleteJob("x")]
    monkeypatch.setattr(executor, "observe", lambda **_: Observed(job=job))
    monkeypatch.setattr(executor_module, "reconcile", lambda *_, **__: actions)
    executor.run_pass(namespace="ns", name="j")
    m = executor.metrics
    assert m.passes.labels(result="ok")._value.get() == 1
    assert m.actions.labels(action="PatchStatus")._value.get() == 1
    assert m.action_failures.labels(action="PatchStatus")._value.get() == 1
    assert m.action_failures.labels(action="DeleteJob")._value.get() == 1
    assert m.action_failures.labels(action="Event")._value.get() == 0
    assert m.phase_counts()["Running"] == 1

    def unreachable(**_: Any) -> Observed:
        raise RuntimeError("apiserver down")

    monkeypatch.setattr(executor, "observe", unreachable)
    with pytest.raises(RuntimeError):
        executor.run_pass(namespace="ns", name="j")
    assert m.passes.labels(result="error")._value.get() == 1


FUZZ_EXAMPLES = 300
_TOKEN_CHARS = st.sampled_from(["", TOKEN, "nope", TOKEN + "x", "Bearer " + TOKEN, "\u00e9" * 40, "x" * 9000])


def _raw(url: str, request: bytes) -> bytes:
    """Sends ``request`` as it is over one connection and returns whatever comes back before it closes. A
    server that refuses a request too large to read (a 70 kB path) closes with the rest of it unread, and the
    kernel then resets the connection: the client may see the reset before or instead of the answer (it did
    once under the suite's load). A dropped connection is no server error; the port serving afterwards is
    what the test checks."""
    host, _, port = url.removeprefix("http://").partition(":")
    chunks = []
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        try:
            conn.sendall(request)
            conn.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """Well-formed requests with any method, path, token and body, or bytes that are no request at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=4096))
    method = draw(
        st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "G\x00T"])
    )
    path = draw(
        st.one_of(
            st.sampled_from(
                ["/healthz", "/metrics", "/", "/metrics/", "/healthz?x=1", "//metrics", "/%2e%2e/"]
            ),
            st.text(
                alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=300
            ).map(lambda t: "/" + t),
            st.just("/" + "a" * 70000),
        )
    )
    headers = [f"Host: fuzz\r\nAuthorization: Bearer {draw(_TOKEN_CHARS)}"]
    headers += [f"X-{i}: {draw(st.text(max_size=50))}" for i in range(draw(st.integers(0, 5)))]
    body = draw(st.binary(max_size=2048))
    if draw(st.booleans()):
        headers.append(f"Content-Length: {len(body)}")
    head = f"{method} {path} HTTP/1.1\r\n" + "\r\n".join(headers) + "\r\n\r\n"
    return head.encode("utf-8", "surrogateescape") + body


# Hypothesis warns when it prints a large generated request (a 70 kB body); the suite makes warnings errors.
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
def test_no_request_makes_the_operators_port_fail_or_stop_serving() -> None:
    """Hypothesis over raw sockets (the port has no OpenAPI schema for schemathesis): whatever arrives, the
    answer is never a server error, /metrics opens with the token only, and the port serves afterwards."""
    metrics = OperatorMetrics()
    url = _server(metrics, lambda: True)
    cases = 0

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None)
    @given(_requests())
    def send(request: bytes) -> None:
        nonlocal cases
        cases += 1
        reply = _raw(url, request)
        status = reply.split(b" ", 2)[1:2]
        assert not status or not status[0].startswith(b"5"), reply[:300]
        if status == [b"200"] and b" /metrics" in request.split(b"\r\n", 1)[0]:
            assert f"Bearer {TOKEN}\r\n".encode() in request, "/metrics opened without the token"

    send()
    print(f"operator port fuzzing: {cases} cases")
    assert cases >= FUZZ_EXAMPLES
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
