"""Event aggregation, as client-go's EventCorrelator does it: an Event equal to one recorded for the same
object a short while ago (same type, reason and message) counts that one up (``count``,
``lastTimestamp``) instead of adding another object. A refusal retried every pass then reads as one
Warning with a growing count in ``kubectl describe ej``, not a screenful of copies.

Kept in the operator's memory: after a restart the first repeat creates a new Event, which is harmless.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from phalanx.api.elasticjob import API_VERSION, KIND
from phalanx.operator.actions import Event
from phalanx.operator.conditions import rfc3339

log = logging.getLogger("phalanx.operator")

WINDOW_S = 600.0
"""How long an Event keeps being counted up after its last occurrence (client-go's default as well)."""
MAX_KEYS = 4096
"""Distinct Events remembered; the oldest are forgotten first."""

Key = tuple[str, ...]


@dataclass
class Seen:
    name: str
    count: int
    first: str
    """RFC 3339 time of the first occurrence: the Event's firstTimestamp."""
    last_at: float


@dataclass(frozen=True)
class Decision:
    """Create a new Event named ``name``, or patch that one to ``count`` (``first`` stays)."""

    name: str
    count: int
    first: str

    @property
    def new(self) -> bool:
        return self.count == 1


class Aggregator:
    """Decides, per occurrence, whether to create an Event or count up an earlier one."""

    def __init__(self, *, window_s: float = WINDOW_S, max_keys: int = MAX_KEYS) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._seen: OrderedDict[Key, Seen] = OrderedDict()
        self._lock = threading.Lock()  # passes of different jobs run on the pass threads

    def record(self, key: Key, *, now: float, stamp: str, new_name: str) -> Decision:
        """One occurrence of the Event ``key`` at ``now`` (``stamp`` its RFC 3339 form); ``new_name`` is
        the name a new Event object gets."""
        with self._lock:
            seen = self._seen.get(key)
            if seen is None or now - seen.last_at > self.window_s:
                seen = Seen(name=new_name, count=1, first=stamp, last_at=now)
            else:
                seen.count += 1
                seen.last_at = now
            self._seen[key] = seen
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
            return Decision(name=seen.name, count=seen.count, first=seen.first)

    def forget(self, key: Key) -> None:
        """The Event is gone (its TTL expired): the next occurrence creates a new one."""
        with self._lock:
            self._seen.pop(key, None)


def record_event(core: Any, aggregator: Aggregator, job: Mapping[str, Any], event: Event) -> None:
    """Records an Event on the job through ``core`` (a kubernetes.client CoreV1Api); a repeat of a recent
    one counts that one up instead of adding another."""
    from kubernetes.client.exceptions import ApiException

    meta = job["metadata"]
    ns = meta["namespace"]
    message = event.message[:1024]
    now = time.time()
    stamp = rfc3339(now)
    key = (ns, meta["uid"], event.type, event.reason, message)
    log.info("%s/%s: %s %s: %s", ns, meta["name"], event.type, event.reason, event.message)
    seen = aggregator.record(key, now=now, stamp=stamp, new_name=_event_name(meta))
    if not seen.new:
        try:
            core.patch_namespaced_event(seen.name, ns, {"count": seen.count, "lastTimestamp": stamp})
            return
        except ApiException as exc:
            if exc.status != 404:
                log.warning("cannot count up event %s: %s", event.reason, exc.reason)
                return
        aggregator.forget(key)  # expired meanwhile (--event-ttl): a new one
        seen = aggregator.record(key, now=now, stamp=stamp, new_name=_event_name(meta))
    body = {
        "metadata": {"name": seen.name, "namespace": ns},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": ns,
            "uid": meta["uid"],
        },
        "type": event.type,
        "reason": event.reason,
        "message": message,
        "source": {"component": "phalanx-operator"},
        "reportingComponent": "phalanx-operator",
        "firstTimestamp": seen.first,
        "lastTimestamp": stamp,
        "count": seen.count,
    }
    try:
        core.create_namespaced_event(ns, body)
    except ApiException as exc:
        aggregator.forget(key)
        log.warning("cannot record event %s: %s", event.reason, exc.reason)


def _event_name(meta: Mapping[str, Any]) -> str:
    return f"{meta['name']}.{secrets.token_hex(8)}"


def pass_error_message(exc: Exception) -> str:
    """What a failed pass records on its job: the exception's type and message, without an API response's
    headers and body (an ApiException's text carries both)."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        text = f"the API server answered {exc.status} {exc.reason}"
    else:
        text = str(exc) or "no message"
    return f"reconciliation pass failed ({type(exc).__name__}): {text}"[:1024]
