"""A node's CPU time capped by a cgroup, for ``phalanx local``: a compute straggler, for real.

A node that a ``slow-cpu`` fault targets starts inside a cgroup of its own (its agent joins it before it
runs, so its training processes and probes are in it too). The fault sets the group's CFS quota: the
kernel then runs the whole node for at most ``cpus`` CPU-seconds per second, as a thermally throttled or
oversubscribed machine does. Works with cgroup v2 (``cpu.max``) and v1 (``cpu.cfs_quota_us``); needs the
right to create cgroups (root).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from phalanx.api.errors import ConfigError

__all__ = ["CpuGroup", "check_privileges", "cpu_controller"]

PERIOD_US = 100_000


def _mounts(text: str) -> list[tuple[Path, str, set[str]]]:
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            out.append((Path(fields[1]), fields[2], set(fields[3].split(","))))
    return out


def cpu_controller(mounts: str | None = None) -> tuple[Path, int]:
    """The directory to create node groups in and the cgroup version of its ``cpu`` controller."""
    table = _mounts(mounts if mounts is not None else Path("/proc/self/mounts").read_text())
    for root, fstype, _ in table:
        if fstype != "cgroup2":
            continue
        with contextlib.suppress(OSError):
            if "cpu" in (root / "cgroup.controllers").read_text().split():
                if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
                    (root / "cgroup.subtree_control").write_text("+cpu")
                return root, 2
    for root, fstype, options in table:
        if fstype == "cgroup" and "cpu" in options and (root / "cpu.cfs_quota_us").exists():
            return root, 1
    raise ConfigError(
        "slow-cpu needs a cgroup cpu controller (cgroup v2 with cpu enabled, or v1's cpu hierarchy) it may "
        "create groups in; none was found in /proc/self/mounts",
        field="inject",
    )


def check_privileges() -> None:
    """Raises ConfigError when this process cannot create node groups (before anything starts)."""
    CpuGroup(f"phalanx-check-{os.getpid()}").remove()


class CpuGroup:
    """A cgroup for one node, without a limit until :meth:`limit`."""

    def __init__(self, name: str) -> None:
        root, self.version = cpu_controller()
        self.path = root / name
        try:
            self.path.mkdir(exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"slow-cpu cannot create the cgroup {self.path}: {exc}", field="inject"
            ) from exc

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv``, run after its process joined the group (``$0`` is the group's ``cgroup.procs``)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def limit(self, cpus: float) -> None:
        """At most ``cpus`` CPU-seconds per second for all the group's processes together."""
        quota = max(1000, round(cpus * PERIOD_US))  # the kernel's smallest quota is 1 ms
        if self.version == 2:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def unlimit(self) -> None:
        if self.version == 2:
            (self.path / "cpu.max").write_text(f"max {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_quota_us").write_text("-1")

    def throttled_s(self) -> float:
        """Time the kernel held the group's processes back for the quota so far (cpu.stat)."""
        stat = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip()
        )
        if self.version == 2:
            return int(stat.get("throttled_usec", 0)) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9

    def remove(self, *, timeout_s: float = 5.0) -> None:
        """SIGKILLs what is left in the group and removes it. The node's process tree was killed before, but
        a process orphaned earlier (a probe whose agent exited) is no longer in that tree; it is still the
        node's."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                for pid in (self.path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # a process stuck in the kernel; the empty group is harmless and named for the job
                time.sleep(0.05)
