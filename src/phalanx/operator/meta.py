"""The metadata every object of an ElasticJob gets: its labels, and the job as its controlling owner, so
that the garbage collector deletes it with the job."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.api.elasticjob import API_VERSION, KIND
from phalanx.operator import names

Obj = dict[str, Any]


def owner_reference(job: Mapping[str, Any]) -> Obj:
    """Makes the ElasticJob the controlling owner: deleting the job garbage-collects the object."""
    meta = job["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(
    job: Mapping[str, Any], name: str, *, component: str, extra: Mapping[str, str] | None = None
) -> Obj:
    """Name, namespace, the operator's labels and the job as the controlling owner."""
    meta = job["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": {**names.labels(meta["name"], component=component), **(extra or {})},
        "ownerReferences": [owner_reference(job)],
    }


def own_secret(name: str, namespace: str, *, kind: str, data: Mapping[str, str]) -> Obj:
    """A Secret of the operator's own (its CA, the metrics token): in its namespace, owned by no job."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": "phalanx"}},
        "type": kind,
        "stringData": dict(data),
    }
