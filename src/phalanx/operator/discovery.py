"""What the cluster serves and holds that the operator's decisions depend on, read through the API
server: the PodGroup API (gang scheduling) and the operator's own admission policies (the templates' one,
:mod:`phalanx.operator.privileged`, and the one that keeps a job's Pods the operator's). A "yes", which only
an administrator's hand changes, is cached; a "no" is asked again."""

from __future__ import annotations

import time
from typing import Any

from phalanx.api.errors import KubernetesError
from phalanx.operator.gang import APIS, KUBERNETES, GangApi

POLICY_SEEN_FOR_S = 60.0
"""How long a found admission policy is taken to exist before it is read again."""


class Discovery:
    def __init__(self, api: Any) -> None:
        from kubernetes import client

        self.custom: Any = client.CustomObjectsApi(api)
        self.admission: Any = client.AdmissionregistrationV1Api(api)
        self._pod_group_apis: set[GangApi] = set()
        self._policy_seen_until: dict[str, float] = {}

    def serves_pod_groups(self, api: GangApi = APIS[KUBERNETES]) -> bool:
        """Whether the API server serves ``api``'s PodGroups (API discovery). A yes is kept for the life of
        the process; a no is asked again, so a cluster whose administrator is enabling the API is not judged
        by a stale answer."""
        from kubernetes.client.exceptions import ApiException

        if api in self._pod_group_apis:
            return True
        try:
            found = self.custom.get_api_resources(api.group, api.version)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise KubernetesError(f"cannot discover the {api.api_version} API: {exc.reason}") from exc
        if any(r.name == api.plural for r in found.resources or []):
            self._pod_group_apis.add(api)
        return api in self._pod_group_apis

    def admission_policy_found(self, name: str) -> bool:
        """Whether the ValidatingAdmissionPolicy ``name`` and its binding of the same name exist ("": no
        check, True). A yes is kept for a minute; a no (either is missing, or the operator may not read them)
        is asked again at each pass that needs it. Any other error fails the pass: a job is never failed for
        an API server's hiccup."""
        from kubernetes.client.exceptions import ApiException

        if not name or time.monotonic() < self._policy_seen_until.get(name, 0.0):
            return True
        try:
            self.admission.read_validating_admission_policy(name)
            self.admission.read_validating_admission_policy_binding(name)
        except ApiException as exc:
            if exc.status in (403, 404):
                return False
            raise KubernetesError(f"cannot read the admission policy {name}: {exc.reason}") from exc
        self._policy_seen_until[name] = time.monotonic() + POLICY_SEEN_FOR_S
        return True


def unguarded_pods(discovery: Discovery, policy: str) -> str | None:
    """What is given up while the operator cannot find ``policy``, the admission policy that lets only it
    give a Pod a job's label or ownerReference (None: found, or no policy named)."""
    try:
        if discovery.admission_policy_found(policy):
            return None
        why = f"cannot find the admission policy {policy} and its binding"
    except KubernetesError as exc:
        why = str(exc)
    return (
        f"{why}: anyone who may create Pods in a job's namespace can give one the job's label and "
        "ownerReference, and the operator takes it for one of the job's members (install "
        "deploy/elasticjob-admission.yaml, or the chart with admission.enabled)"
    )
