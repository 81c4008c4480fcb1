"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

Several operator replicas run; the one holding the Lease reconciles, the others wait. The holder renews the
Lease every ``retry_s``; a standby takes it over once it has seen the same renewal for ``lease_s`` on its own
clock (so clock skew between machines does not matter). The holder stops acting ``renew_deadline_s`` after
the start of its last successful renewal, strictly before any standby may take the Lease over
(``renew_deadline_s < lease_s``): two replicas never act at once, even if the holder's renewals merely stall.

The timings are client-go's defaults (15 s / 10 s / 2 s) scaled by about a half, so that a killed leader is
replaced within ``lease_s + retry_s`` plus the new leader's start (well under 15 s).

:func:`decide` is the pure part (what to do with the Lease as read); :class:`LeaderElector` does the I/O in
a thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger("phalanx.operator.leader")

ENVIRONMENT = (
    "PHALANX_OPERATOR_LEADER_ELECTION",  # true (default) or false: a single replica that needs no Lease
    "PHALANX_OPERATOR_LEASE_NAME",  # default phalanx-operator
    "PHALANX_OPERATOR_LEASE_NAMESPACE",  # default: the service account's namespace, else phalanx-system
)
"""The operator's environment variables for leader election (``phalanx operator`` reads them)."""


@dataclass(frozen=True)
class LeaseTiming:
    lease_s: float = 8.0
    """How long a standby waits, after it last saw the Lease renewed, before taking it over."""
    renew_deadline_s: float = 5.0
    """How long the holder keeps acting after the start of its last successful renewal."""
    retry_s: float = 1.0
    """How often the holder renews and a standby looks."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_s < self.renew_deadline_s < self.lease_s:
            raise ValueError("lease timings need 0 < retry_s < renew_deadline_s < lease_s")


@dataclass(frozen=True)
class Observation:
    """What a candidate last saw of the Lease: its record and when (monotonic, this process's clock)."""

    record: tuple[str, str, str]
    """(holderIdentity, renewTime, resourceVersion): any change means the holder is alive."""
    seen_at: float


def record_of(lease: Mapping[str, Any]) -> tuple[str, str, str]:
    spec = lease.get("spec") or {}
    meta = lease.get("metadata") or {}
    return (
        str(spec.get("holderIdentity") or ""),
        str(spec.get("renewTime") or ""),
        str(meta.get("resourceVersion") or ""),
    )


def decide(
    lease: Mapping[str, Any] | None,
    *,
    identity: str,
    last: Observation | None,
    now: float,
    timing: LeaseTiming,
) -> tuple[str, Observation | None]:
    """What to do with the Lease as read: ``"create"`` (there is none), ``"take"`` (write ourselves in as
    holder: ours already, released, or expired by our own clock) or ``"wait"``. Also returns the observation
    to remember."""
    if lease is None:
        return "create", None
    record = record_of(lease)
    holder = record[0]
    if holder == identity or not holder:
        return "take", Observation(record, now)
    if last is None or last.record != record:
        return "wait", Observation(record, now)  # a renewal we had not seen: the holder lives
    if now - last.seen_at >= timing.lease_s:
        return "take", last
    return "wait", last


def _micro_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Runs the election in a daemon thread. :meth:`wait_until_leading` blocks until this replica leads;
    :meth:`leading` says whether it may act right now (cheap: a clock comparison, called before every
    write); ``on_lost`` is called once, from the thread, when leadership is lost."""

    def __init__(
        self,
        *,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        on_lost: Callable[[], None],
        timing: LeaseTiming = LeaseTiming(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from kubernetes import client

        self.coordination: Any = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.timing = timing
        self._on_lost = on_lost
        self._clock = clock
        self._valid_until = 0.0  # monotonic: the end of this replica's right to act
        self._led = threading.Event()
        self._stop = threading.Event()
        self._observed: Observation | None = None
        self._mine: dict[str, Any] | None = None
        """The Lease as this replica last wrote it: a leader renews from it without reading it first (one
        request per renewal, not two); a conflict means someone else wrote, and the next attempt reads."""
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> LeaderElector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def release(self) -> None:
        """Stops the election and, if this replica holds the Lease, clears its holder, so that a standby
        takes over at its next look instead of waiting the Lease out (a graceful shutdown)."""
        from kubernetes.client.exceptions import ApiException

        self._stop.set()
        was_leading = self._led.is_set()
        self._valid_until = 0.0
        self._led.clear()
        if not was_leading:
            return
        try:
            lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            self.coordination.replace_namespaced_lease(self.name, self.namespace, lease)
            log.info("lease %s/%s: released by %s", self.namespace, self.name, self.identity)
        except ApiException as exc:  # the standby then waits the Lease out: slower, never wrong
            log.warning("lease %s/%s: cannot release: %s", self.namespace, self.name, exc.reason)

    def leading(self) -> bool:
        return self._led.is_set() and self._clock() < self._valid_until

    def wait_until_leading(self, timeout: float | None = None) -> bool:
        return self._led.wait(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                renewed = self._try_acquire_or_renew(started)
            except Exception as exc:  # an API error is a failed attempt, never the end of the thread
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
                renewed = False
            if renewed:
                self._valid_until = started + self.timing.renew_deadline_s
                if not self._led.is_set():
                    log.info("lease %s/%s: %s is the leader", self.namespace, self.name, self.identity)
                    self._led.set()
            elif self._led.is_set() and (not self.leading() or self._held_by_other()):
                self._lose()
                return
            self._stop.wait(self.timing.retry_s)

    def _held_by_other(self) -> bool:
        return self._observed is not None and self._observed.record[0] not in ("", self.identity)

    def _lose(self) -> None:
        self._valid_until = 0.0
        self._led.clear()
        log.error("lease %s/%s: %s lost the leadership; stopping", self.namespace, self.name, self.identity)
        self._on_lost()

    def _try_acquire_or_renew(self, now: float) -> bool:
        from kubernetes.client.exceptions import ApiException

        lease: dict[str, Any] | None = self._mine if self._led.is_set() else None
        self._mine = None
        if lease is None:
            try:
                lease = self.coordination.api_client.sanitize_for_serialization(
                    self.coordination.read_namespaced_lease(self.name, self.namespace)
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                lease = None
        what, self._observed = decide(
            lease, identity=self.identity, last=self._observed, now=now, timing=self.timing
        )
        if what == "wait":
            return False
        stamp = _micro_time(time.time())
        spec = dict((lease or {}).get("spec") or {})
        transitions = int(spec.get("leaseTransitions") or 0)
        if spec.get("holderIdentity") != self.identity:
            spec.update(acquireTime=stamp, leaseTransitions=transitions + (1 if lease else 0))
        spec.update(
            holderIdentity=self.identity, leaseDurationSeconds=int(self.timing.lease_s), renewTime=stamp
        )
        body = {"metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
        try:
            if lease is None:
                written = self.coordination.create_namespaced_lease(self.namespace, body)
            else:
                # The resourceVersion makes the write conditional: of two standbys taking an expired Lease
                # at once, one gets 409 Conflict.
                body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
                written = self.coordination.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._mine = self.coordination.api_client.sanitize_for_serialization(written)
        return True
