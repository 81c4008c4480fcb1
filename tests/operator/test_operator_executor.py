"""The executor's side of the DeleteJob action (spec.ttlAfterFinished), against a fake custom-objects API."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from phalanx.api.settings import OperatorSettings
from phalanx.operator.actions import DeleteJob
from phalanx.operator.executor import Executor

JOB = {"metadata": {"name": "j", "namespace": "ns", "uid": "u-1"}}


class FakeCustom:
    def __init__(self, status: int | None = None) -> None:
        self.status = status
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def delete_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))
        if self.status is not None:
            raise ApiException(status=self.status, reason="nope")


def executor(custom: FakeCustom) -> Executor:
    ex = Executor(api=client.ApiClient(), settings=OperatorSettings())
    ex.custom = custom
    return ex


def test_delete_job_is_a_foreground_delete_of_that_uid_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    custom = FakeCustom()
    with caplog.at_level(logging.INFO, logger="phalanx.operator"):
        executor(custom).apply(JOB, [DeleteJob("deleting the job: Succeeded since ...")])
    assert custom.calls == [
        (
            ("phalanx.dev", "v1alpha1", "ns", "elasticjobs", "j"),
            {"propagation_policy": "Foreground", "body": {"preconditions": {"uid": "u-1"}}},
        )
    ]
    assert "ns/j: deleting the job: Succeeded since ..." in caplog.text


@pytest.mark.parametrize("status", [404, 409])
def test_a_job_already_gone_or_recreated_is_done(status: int, caplog: pytest.LogCaptureFixture) -> None:
    custom = FakeCustom(status)
    executor(custom).apply(JOB, [DeleteJob("x")])
    assert len(custom.calls) == 1
    assert "failed" not in caplog.text


def test_other_errors_are_logged_and_the_next_pass_tries_again(caplog: pytest.LogCaptureFixture) -> None:
    custom = FakeCustom(403)
    executor(custom).apply(JOB, [DeleteJob("x")])
    assert "ns/j: DeleteJob failed: 403 nope" in caplog.text


def test_a_failed_pass_is_recorded_without_the_api_response() -> None:
    """An ApiException's text carries the response's headers and body; the job's condition gets neither."""
    from phalanx.operator.events import pass_error_message

    exc = ApiException(status=500, reason="Internal Server Error")
    exc.body = '{"message": "secret-looking body"}'
    exc.headers = {"Authorization": "Bearer abc"}
    message = pass_error_message(exc)
    assert (
        message
        == "reconciliation pass failed (ApiException): the API server answered 500 Internal Server Error"
    )
    assert pass_error_message(TypeError("'int' object is not iterable")) == (
        "reconciliation pass failed (TypeError): 'int' object is not iterable"
    )
    assert len(pass_error_message(ValueError("x" * 5000))) == 1024


def test_a_pass_that_raises_is_recorded_and_does_not_escape(caplog: pytest.LogCaptureFixture) -> None:
    """reconcile_job never lets one job's exception out (the pass thread would only log it, and the log
    would be the only trace): it records the failure on the job, and the next trigger runs a pass again."""
    recorded: list[tuple[str, str, str]] = []
    ex = Executor(api=client.ApiClient(), settings=OperatorSettings())

    def explode(*, namespace: str, name: str) -> list[Any]:
        raise TypeError("'int' object is not iterable")

    ex.run_pass = explode  # type: ignore[method-assign]
    ex._record_pass_error = lambda ns, name, exc: recorded.append((ns, name, type(exc).__name__))  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="phalanx.operator"):
        ex.reconcile_job(namespace="ns", name="j")
        ex.reconcile_job(namespace="ns", name="j")
    assert recorded == [("ns", "j", "TypeError")] * 2
    assert "ns/j: reconciliation pass failed" in caplog.text
