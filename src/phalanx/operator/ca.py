"""The operator's certificate authority, kept in a Secret of its own namespace (operator setting
``tls_ca_secret``): it signs every job master's certificate (:mod:`phalanx.operator.tls`)."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from phalanx.api.errors import KubernetesError
from phalanx.operator import tls
from phalanx.operator.meta import own_secret

log = logging.getLogger("phalanx.operator")


def load_authority(core: Any, *, name: str, namespace: str, may_act: Callable[[], bool]) -> tls.Authority:
    """The CA in the Secret ``namespace/name``, made (by the leader, ``may_act``, once) when there is none.
    Two replicas racing to make it: the second's create conflicts and it reads the first's. ``core``: a
    kubernetes.client CoreV1Api."""
    from kubernetes.client.exceptions import ApiException

    try:
        found = core.read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        if not may_act():
            raise KubernetesError(f"the CA Secret {namespace}/{name} does not exist yet") from exc
        made = tls.new_authority(common_name=f"phalanx masters ({namespace}/{name})", now=datetime.now(UTC))
        data = {tls.CERT_KEY: made.cert_pem, tls.KEY_KEY: made.key_pem}
        body = own_secret(name, namespace, kind="kubernetes.io/tls", data=data)
        try:
            core.create_namespaced_secret(namespace, body)
            log.info("made the CA Secret %s/%s that signs the masters' certificates", namespace, name)
            return made
        except ApiException as again:
            if again.status != 409:
                raise
            found = core.read_namespaced_secret(name, namespace)
    data = {k: base64.b64decode(v).decode() for k, v in (found.data or {}).items()}
    if tls.CERT_KEY not in data or tls.KEY_KEY not in data:
        raise KubernetesError(
            f"the CA Secret {namespace}/{name} needs the keys {tls.CERT_KEY} and {tls.KEY_KEY}"
        )
    return tls.Authority(data[tls.CERT_KEY], data[tls.KEY_KEY])
