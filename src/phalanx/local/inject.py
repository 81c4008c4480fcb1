"""Fault-injection specs for ``phalanx local --inject``: a pure parser with clear errors.

Form: ``KIND@key=value,...``. Kinds: ``kill-worker`` (SIGKILL one rank), ``kill-node`` (SIGKILL an agent
and its workers), ``hang-worker`` (SIGSTOP one rank), ``kill-master`` (SIGKILL the master and restart it
on the same state), ``delay-node`` (add ``latency=`` each way to the node's link to the master) and
``partition-node`` (cut that link: silence, no error; see :mod:`phalanx.local.relay`), ``slow-network``
(limit all of the node's traffic with the other nodes to ``rate=``, e.g. ``rate=20mbit``; see
:mod:`phalanx.local.fabric`), ``slow-cpu`` (cap the node's processes at ``cpu=`` CPUs, e.g. ``cpu=200m``;
see :mod:`phalanx.local.cpulimit`), ``kill-checkpoint-host`` (SIGKILL the node's flash-checkpoint host)
and ``hang-checkpoint-host`` (SIGSTOP it; its agent replaces either, and training should not notice).
Keys: ``step=`` (fire when the rank's beacon reaches that step), ``after=`` (seconds since the job
started), ``node=`` (node index, default 0), ``rank=`` (local rank, default 0), ``for=`` (the lasting
faults: heal after this long; default never). A spec needs ``step`` or ``after``; with both, both must
hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.api.errors import ConfigError
from phalanx.api.settings import parse_duration

KINDS = (
    "kill-worker", "kill-node", "hang-worker", "kill-master", "delay-node", "partition-node", "slow-network",
    "slow-cpu", "kill-checkpoint-host", "hang-checkpoint-host",
)  # fmt: skip
NETWORK_KINDS = ("delay-node", "partition-node")
"""Faults of a node's link to the master: the node reaches the master through a relay."""
SLOW_KINDS = ("slow-network", "slow-cpu")
"""Faults that leave the node working, only slower: the job may notice them or not."""
LASTING_KINDS = NETWORK_KINDS + SLOW_KINDS
"""Faults that last until healed (``for=``) or until the end."""
HOST_KINDS = ("kill-checkpoint-host", "hang-checkpoint-host")
"""Faults of a node's flash-checkpoint host, which its agent replaces without the job noticing."""
UNNOTICED_KINDS = LASTING_KINDS + HOST_KINDS
"""Faults the job may rightly not notice: unnoticed, there is nothing to recover from."""
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_KEYS = {
    "kill-worker": {"step", "after", "node", "rank"},
    "hang-worker": {"step", "after", "node", "rank"},
    "kill-node": {"step", "after", "node"},
    "kill-master": {"step", "after"},
    "delay-node": {"step", "after", "node", "latency", "for"},
    "partition-node": {"step", "after", "node", "for"},
    "slow-network": {"step", "after", "node", "rate", "for"},
    "slow-cpu": {"step", "after", "node", "cpu", "for"},
    "kill-checkpoint-host": {"step", "after", "node"},
    "hang-checkpoint-host": {"step", "after", "node"},
}


@dataclass(frozen=True, kw_only=True)
class Injection:
    kind: str
    step: int | None = None
    after_s: float | None = None
    node: int = 0
    rank: int = 0
    latency_s: float = 0.0
    rate_bit_s: int = 0
    """slow-network: the node's bandwidth, bits per second, each way."""
    cpus: float = 0.0
    """slow-cpu: CPU-seconds per second the node's processes may use together."""
    for_s: float | None = None
    """How long a lasting fault lasts (None: until the end)."""
    spec: str = ""

    def due(self, *, step: int, elapsed_s: float) -> bool:
        """Whether the fault fires, given the target rank's step and the time since the job started."""
        if self.step is not None and step < self.step:
            return False
        return not (self.after_s is not None and elapsed_s < self.after_s)


def _int(value: str, *, key: str, spec: str) -> int:
    try:
        number = int(value)
    except ValueError as exc:
        raise ConfigError(f"{key}= needs a whole number, got {value!r} in {spec!r}", field="inject") from exc
    if number < 0:
        raise ConfigError(f"{key}= cannot be negative in {spec!r}", field="inject")
    return number


def _rate(value: str, *, spec: str) -> int:
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number) :]
    try:
        rate = float(number) * _RATE_UNITS[unit]
    except (ValueError, KeyError):
        raise ConfigError(
            f"rate= takes a number and one of {', '.join(_RATE_UNITS)}, e.g. rate=20mbit; "
            f"got {value!r} in {spec!r}",
            field="inject",
        ) from None
    if rate < 8000:  # below one 1 KiB packet a second TCP gives up on everything
        raise ConfigError(f"rate= must be at least 8kbit, got {value!r} in {spec!r}", field="inject")
    return round(rate)


def _cpus(value: str, *, spec: str) -> float:
    """A Kubernetes CPU quantity: ``250m`` or ``0.25``."""
    try:
        cpus = float(value[:-1]) / 1000 if value.endswith("m") else float(value)
    except ValueError:
        raise ConfigError(
            f"cpu= takes CPUs as Kubernetes writes them, e.g. cpu=200m or cpu=0.2; got {value!r} in {spec!r}",
            field="inject",
        ) from None
    if not cpus >= 0.01:
        raise ConfigError(f"cpu= must be at least 10m, got {value!r} in {spec!r}", field="inject")
    return cpus


def parse(spec: str) -> Injection:
    """Parses one ``--inject`` value."""
    kind, sep, rest = spec.strip().partition("@")
    if kind not in KINDS:
        raise ConfigError(
            f"unknown fault {kind!r} in {spec!r}; use one of {', '.join(KINDS)}", field="inject"
        )
    if not sep or not rest.strip():
        raise ConfigError(
            f"{spec!r} needs a trigger, e.g. {kind}@step=20 or {kind}@after=10s", field="inject"
        )
    values: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.strip().partition("=")
        if not eq or not value:
            raise ConfigError(f"expected key=value, got {part!r} in {spec!r}", field="inject")
        if key not in _KEYS[kind]:
            raise ConfigError(
                f"{kind} does not take {key}=; it takes {', '.join(sorted(_KEYS[kind]))} (in {spec!r})",
                field="inject",
            )
        if key in values:
            raise ConfigError(f"{key}= given twice in {spec!r}", field="inject")
        values[key] = value
    if "step" not in values and "after" not in values:
        raise ConfigError(f"{spec!r} needs step= or after= to say when it fires", field="inject")
    latency = parse_duration(values["latency"], name="inject latency") if "latency" in values else 0.0
    if kind == "delay-node" and latency <= 0:
        raise ConfigError(f"{spec!r} needs latency= above 0, e.g. latency=300ms", field="inject")
    for key, kind_needing in (("rate", "slow-network"), ("cpu", "slow-cpu")):
        if kind == kind_needing and key not in values:
            example = "rate=20mbit" if key == "rate" else "cpu=200m"
            raise ConfigError(f"{spec!r} needs {key}=, e.g. {kind}@after=10s,{example}", field="inject")
    for_s = parse_duration(values["for"], name="inject for") if "for" in values else None
    if for_s is not None and for_s <= 0:
        raise ConfigError(
            f"for= must be above 0 in {spec!r}; leave it out for a fault that lasts", field="inject"
        )
    return Injection(
        kind=kind,
        step=_int(values["step"], key="step", spec=spec) if "step" in values else None,
        after_s=parse_duration(values["after"], name="inject after") if "after" in values else None,
        node=_int(values.get("node", "0"), key="node", spec=spec),
        rank=_int(values.get("rank", "0"), key="rank", spec=spec),
        latency_s=latency,
        rate_bit_s=_rate(values["rate"], spec=spec) if "rate" in values else 0,
        cpus=_cpus(values["cpu"], spec=spec) if "cpu" in values else 0.0,
        for_s=for_s,
        spec=spec,
    )


def validate(injections: list[Injection], *, initial_nodes: int, nproc_per_node: int) -> None:
    """Checks the targets exist in the cluster as it starts."""
    for inj in injections:
        if inj.node >= initial_nodes:
            raise ConfigError(
                f"node={inj.node} in {inj.spec!r}, but only {initial_nodes} nodes start", field="inject"
            )
        if inj.rank >= nproc_per_node:
            raise ConfigError(
                f"rank={inj.rank} in {inj.spec!r}, but each node runs {nproc_per_node} processes",
                field="inject",
            )
