"""The executor's side of the DeleteJob action (spec.ttlAfterFinished), against a fake custom-objects API."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from phalanx.api.settings import OperatorSettings
from phalanx.operator.executor import Executor
from phalanx.operator.reconcile import DeleteJob

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
