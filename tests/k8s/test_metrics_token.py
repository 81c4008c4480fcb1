"""The metrics token in a Secret of the operator's namespace (setting ``metrics_token_secret``, the Helm
chart's way): made with a random token when missing, the same token for every replica (two racing to make
it included), a Secret someone else made used as it is, and one without a usable token refused with its
name. Against the real API server."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_harness.controlplane import ControlPlane, write_kubeconfig
from kubernetes import client
from kubernetes import config as k8s_config

from phalanx.api.errors import ConfigError, KubernetesError
from phalanx.api.settings import OperatorSettings
from phalanx.operator.metrics_token import load_metrics_token, operator_metrics_token

pytestmark = [pytest.mark.k8s, pytest.mark.integration]

NAMESPACE = "metrics-token-test"


@pytest.fixture(scope="module")
def core(control_plane: ControlPlane) -> Iterator[Any]:
    api = k8s_config.new_client_from_config(config_file=str(control_plane.kubeconfig))  # type: ignore[no-untyped-call]
    control_plane.kubectl("create", "namespace", NAMESPACE)
    yield client.CoreV1Api(api)
    control_plane.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def _stored(core: Any, name: str, key: str = "token") -> str:
    return base64.b64decode(core.read_namespaced_secret(name, NAMESPACE).data[key]).decode()


def test_a_missing_secret_is_made_once_and_every_replica_reads_the_same_token(core: Any) -> None:
    settings = OperatorSettings(metrics_token_secret="made", metrics_token_secret_key="bearer")
    tokens: list[str] = []

    def replica() -> None:
        tokens.append(operator_metrics_token(settings, core=core, namespace=NAMESPACE))

    racers = [threading.Thread(target=replica) for _ in range(4)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(timeout=30)
    assert len(tokens) == 4
    assert len(set(tokens)) == 1, "every replica must hand the masters the same token"
    assert len(tokens[0]) >= 32
    assert _stored(core, "made", "bearer") == tokens[0]
    assert operator_metrics_token(settings, core=core, namespace=NAMESPACE) == tokens[0]  # a restart


def test_a_secret_brought_by_its_owner_is_used_as_it_is(core: Any) -> None:
    own = "a-token-of-the-platform-team-0123456789"
    core.create_namespaced_secret(
        NAMESPACE, {"metadata": {"name": "brought"}, "stringData": {"token": own + "\n"}}
    )
    assert load_metrics_token(core, name="brought", namespace=NAMESPACE) == own


@pytest.mark.parametrize(
    ("name", "data", "why"),
    [
        ("short", {"token": "short"}, "at least 16"),
        ("other-key", {"other": "x" * 32}, "'token'"),
        ("spaces", {"token": "two words " * 3}, "spaces"),
    ],
)
def test_a_secret_without_a_usable_token_is_refused_and_left_alone(
    core: Any, name: str, data: dict[str, str], why: str
) -> None:
    core.create_namespaced_secret(NAMESPACE, {"metadata": {"name": name}, "stringData": data})
    with pytest.raises(ConfigError, match=why) as refused:
        load_metrics_token(core, name=name, namespace=NAMESPACE)
    assert f"{NAMESPACE}/{name}" in str(refused.value)
    assert refused.value.field == "metrics_token_secret"
    assert _stored(core, name, next(iter(data))) == next(iter(data.values()))  # never overwritten


def test_an_operator_without_the_rights_is_told_which_ones(
    control_plane: ControlPlane, core: Any, tmp_path: Path
) -> None:
    control_plane.kubectl("create", "serviceaccount", "rightless", "-n", NAMESPACE)
    token = control_plane.kubectl("create", "token", "rightless", "-n", NAMESPACE).strip()
    kubeconfig = write_kubeconfig(
        tmp_path / "rightless", server=control_plane.server, ca=control_plane.ca, token=token
    )
    api = k8s_config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
    with pytest.raises(KubernetesError, match="needs get on that Secret and create on Secrets"):
        load_metrics_token(client.CoreV1Api(api), name="never-made", namespace=NAMESPACE)
