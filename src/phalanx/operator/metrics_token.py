"""The metrics token the operator hands to every job's master (and checks on its own /metrics): from a file
(``metrics_token_file``) or from a Secret of the operator's own namespace (``metrics_token_secret``), made
with a random token when it does not exist yet, the way the operator's CA is (:mod:`phalanx.operator.ca`).
A Secret keeps the Helm chart's render free of secrets: the chart names the Secret, the operator fills it."""

from __future__ import annotations

import base64
import logging
import secrets
from typing import Any

from phalanx.api.errors import ConfigError, KubernetesError
from phalanx.api.settings import OperatorSettings
from phalanx.operator.meta import own_secret
from phalanx.operator.supporting import METRICS_TOKEN_KEY, read_metrics_token

log = logging.getLogger("phalanx.operator")


def operator_metrics_token(settings: OperatorSettings, *, core: Any, namespace: str) -> str:
    """The token under ``settings`` ("" when the masters get none). ``core``: a kubernetes.client
    CoreV1Api, used only with metrics_token_secret; ``namespace``: the operator's own."""
    if settings.metrics_token_secret:
        return load_metrics_token(
            core,
            name=settings.metrics_token_secret,
            key=settings.metrics_token_secret_key,
            namespace=namespace,
        )
    return read_metrics_token(settings.metrics_token_file)


def load_metrics_token(core: Any, *, name: str, key: str = METRICS_TOKEN_KEY, namespace: str) -> str:
    """The token under ``key`` of the Secret ``namespace/name``, the Secret made with a random token when
    there is none. Two replicas racing to make it: the second's create conflicts and it reads the first's.
    A Secret that exists without a usable token is an error naming it, never overwritten: someone put it
    there, and Prometheus presents what it holds."""
    from kubernetes.client.exceptions import ApiException

    try:
        return _load(core, name=name, key=key, namespace=namespace)
    except ApiException as exc:
        if exc.status != 403:
            raise
        raise KubernetesError(
            f"the operator may not read or make the metrics token Secret {namespace}/{name}: it needs get "
            f"on that Secret and create on Secrets in {namespace} (the chart's Role "
            "<release>-operator-metrics-token)"
        ) from exc


def _load(core: Any, *, name: str, key: str, namespace: str) -> str:
    from kubernetes.client.exceptions import ApiException

    try:
        found = core.read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        body = own_secret(name, namespace, kind="Opaque", data={key: secrets.token_urlsafe(36)})
        try:
            core.create_namespaced_secret(namespace, body)
            log.info("made the metrics token Secret %s/%s", namespace, name)
        except ApiException as again:
            if again.status != 409:
                raise
        found = core.read_namespaced_secret(name, namespace)
    encoded = (found.data or {}).get(key, "")
    token = base64.b64decode(encoded).decode(errors="replace").strip()
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ConfigError(
            f"the Secret {namespace}/{name} must hold one token of at least 16 characters without spaces "
            f"under the key {key!r}",
            field="metrics_token_secret",
        )
    return token
