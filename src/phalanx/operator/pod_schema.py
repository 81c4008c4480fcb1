"""The Pod templates' schema in the CRD: Kubernetes' own PodSpec (``pod_schema.json``, which
``scripts/gen-pod-schema`` makes from the Kubernetes OpenAPI of the version the tests run), so that a
misspelt Pod field is refused by ``kubectl apply`` and ``kubectl explain elasticjob.spec.template.spec``
describes every field, as for a Deployment's template."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("pod_schema.json")


@cache
def _generated() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SOURCE.read_text())
    return loaded


def kubernetes_version() -> str:
    """The Kubernetes module the schema was made from (``kubernetes@v1.37.1``)."""
    return str(_generated()["source"])


def pod_spec() -> dict[str, Any]:
    """A PodSpec's schema (a copy: the CRD's YAML gets no aliases)."""
    return copy.deepcopy(_generated()["PodSpec"])


def field(*path: str) -> dict[str, Any]:
    """The schema of a field of a PodSpec by its path (``"containers", "items", "securityContext"``)."""
    node = _generated()["PodSpec"]
    for step in path:
        node = node[step] if step == "items" else node["properties"][step]
    return copy.deepcopy(node)


def worker_template() -> dict[str, Any]:
    """``spec.template``: a Pod template, its spec typed; labels and annotations in its metadata (anything
    else there is kept and ignored, as in a Deployment's template)."""
    spec = pod_spec()
    spec["description"] = (
        "Spec of the worker Pods (Kubernetes' PodSpec); the first container runs phalanx-run and the "
        "training script (its command and args)."
    )
    spec["required"] = sorted({*spec.get("required", []), "containers"})
    spec["properties"]["containers"]["minItems"] = 1
    string_map = {"type": "object", "additionalProperties": {"type": "string"}}
    return {
        "type": "object",
        "description": "Pod template of the worker Pods.",
        "required": ["spec"],
        "properties": {
            "metadata": {
                "type": "object",
                "description": "Labels and annotations of the worker Pods (the operator's own labels win).",
                "x-kubernetes-preserve-unknown-fields": True,
                "properties": {"labels": string_map, "annotations": copy.deepcopy(string_map)},
            },
            "spec": spec,
        },
    }
