"""A private network for ``phalanx local``'s nodes, so that a node's own network can be made slow.

Each node runs in a network namespace of its own, as a Pod does, with one interface ``eth0`` at
``10.250.X.Y/16``. The ``eth0`` of every node is one end of a veth pair whose other end is a port of a
bridge, the switch, in a namespace of its own (the fabric). Nothing is added to the host's network, and
everything goes away with the processes that hold the namespaces.

All of a node's traffic with the other nodes crosses its port: the c10d store, the collectives of its
training processes, its probes. :meth:`Fabric.throttle` puts a token bucket (``tc`` qdisc ``tbf``) on
both directions of that port, the kernel's own rate limiter, so the node's packets really wait: a
degraded NIC or a link that came up at a lower speed. The node's link to the master is not on this
network: it is a Unix socket (a relay of :mod:`phalanx.local.relay`), as the control network of a
cluster is often not its data network.

It needs the privileges to create network namespaces (root, CAP_SYS_ADMIN and CAP_NET_ADMIN);
:func:`check_privileges` says so clearly where they are missing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx.api.errors import ConfigError

__all__ = ["Fabric", "NodeNet", "check_privileges"]

IFNAME = "eth0"
_SUBNET = "10.250.0.0/16"
_BRIDGE = "switch"
_TBF_BURST = "64kb"  # about one 64 KiB segment: the bucket smooths bursts, it does not let them through
_TBF_LATENCY = "2s"  # how long a packet may wait in the bucket before it is dropped (TCP resends it)
_KILL_SCANS = 20  # a killed process leaves its namespace within a scan or two; a zombie is in none


def _address(index: int) -> str:
    """Node ``index``'s address: 10.250.0.2, ..., 10.250.0.255, 10.250.1.0, ... (the .1 is left free)."""
    host = index + 2
    return f"10.250.{host // 256}.{host % 256}"


def _holder() -> subprocess.Popen[bytes]:
    """A process in a new network namespace that lives until its stdin closes: when ``phalanx local`` ends
    or dies, the pipe closes, the holder exits and the namespace is gone once its last process is. It says
    when it is in the new namespace: until then its /proc/PID/ns/net is still this process's."""
    holder = subprocess.Popen(
        ["unshare", "--net", "--", "sh", "-c", "echo ready; read _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None
    if holder.stdout.readline() != b"ready\n":
        _release(holder)
        raise OSError(f"unshare --net exited with {holder.wait()}")
    return holder


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise OSError(f"{' '.join(argv)} failed: {result.stderr.strip() or result.returncode}")


def check_privileges() -> None:
    """Raises ConfigError when this process cannot create and wire network namespaces."""
    try:
        probe = subprocess.run(
            ["unshare", "--net", "--", "ip", "link", "add", "phx-check", "type", "veth", "peer", "name", "c"],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError as exc:
        raise ConfigError(
            f"a private network for the nodes needs unshare and ip (util-linux, iproute2): {exc}",
            field="inject",
        ) from exc
    if probe.returncode != 0:
        raise ConfigError(
            "a private network for the nodes needs the privileges to create network namespaces (root, or "
            f"CAP_SYS_ADMIN and CAP_NET_ADMIN): {probe.stderr.strip()}",
            field="inject",
        )


@dataclass
class NodeNet:
    """One node's place on the fabric."""

    index: int
    address: str
    port: str
    """The node's port on the switch, in the fabric's namespace."""
    holder: subprocess.Popen[bytes]

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the node's network namespace (nsenter execs it: the pid stays the same)."""
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--", *argv]


class Fabric:
    def __init__(self) -> None:
        self._switch = _holder()
        self.nodes: dict[int, NodeNet] = {}
        try:
            self._in_fabric("ip", "link", "add", _BRIDGE, "type", "bridge")
            self._in_fabric("ip", "link", "set", _BRIDGE, "up")
        except OSError:
            self.close()
            raise

    def _in_fabric(self, *argv: str) -> None:
        _run("nsenter", f"--net=/proc/{self._switch.pid}/ns/net", "--", *argv)

    def add_node(self, index: int) -> NodeNet:
        """A namespace for node ``index``, plugged into the switch, with ``lo`` and ``eth0`` up."""
        holder = _holder()
        node = NodeNet(index=index, address=_address(index), port=f"n{index}", holder=holder)
        self.nodes[index] = node
        switch, ns = str(self._switch.pid), str(holder.pid)
        _run(
            "ip",
            "link",
            "add",
            node.port,
            "netns",
            switch,
            "type",
            "veth",
            "peer",
            "name",
            IFNAME,
            "netns",
            ns,
        )
        self._in_fabric("ip", "link", "set", node.port, "master", _BRIDGE, "up")
        inside = node.enter
        _run(*inside(["ip", "addr", "add", f"{node.address}/16", "dev", IFNAME]))
        _run(*inside(["ip", "link", "set", IFNAME, "up"]))
        _run(*inside(["ip", "link", "set", "lo", "up"]))
        return node

    def throttle(self, index: int, *, rate_bit_s: int) -> None:
        """Limits node ``index``'s traffic to ``rate_bit_s`` bits per second in each direction."""
        node = self.nodes[index]
        tbf = ["tbf", "rate", f"{rate_bit_s}bit", "burst", _TBF_BURST, "latency", _TBF_LATENCY]
        _run(*node.enter(["tc", "qdisc", "replace", "dev", IFNAME, "root", *tbf]))  # what the node sends
        self._in_fabric("tc", "qdisc", "replace", "dev", node.port, "root", *tbf)  # what it receives

    def unthrottle(self, index: int) -> None:
        node = self.nodes[index]
        _run(*node.enter(["tc", "qdisc", "del", "dev", IFNAME, "root"]))
        self._in_fabric("tc", "qdisc", "del", "dev", node.port, "root")

    def remove_node(self, index: int) -> None:
        """Ends the node's namespace: SIGKILLs every process still in it (its agent's tree was killed before,
        but a probe orphaned earlier is no longer in that tree; it is still the node's), then releases the
        holder. The namespace vanishes with its last process, and the veth pair with it."""
        node = self.nodes.pop(index, None)
        if node is None:
            return
        try:
            netns = os.readlink(f"/proc/{node.holder.pid}/ns/net")
        except OSError:
            netns = ""
        if netns:
            # Until a scan finds nobody: a process may fork, or finish joining, while /proc is read.
            for _ in range(_KILL_SCANS):
                if not _kill_in_netns(netns, spare=node.holder.pid):
                    break
                time.sleep(0.05)
        _release(node.holder)
        if netns:
            _kill_in_netns(netns, spare=None)  # one that joined through the holder while it was exiting

    def close(self) -> None:
        for index in list(self.nodes):
            self.remove_node(index)
        _release(self._switch)


def _kill_in_netns(netns: str, *, spare: int | None) -> int:
    """SIGKILLs every process whose network namespace is ``netns`` (as ``readlink /proc/PID/ns/net``
    names it), except ``spare``; returns how many it found."""
    found = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == spare:
            continue
        with contextlib.suppress(OSError):
            if os.readlink(proc / "ns" / "net") == netns:
                os.kill(int(proc.name), signal.SIGKILL)
                found += 1
    return found


def _release(holder: subprocess.Popen[bytes]) -> None:
    for pipe in (holder.stdin, holder.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        holder.wait(timeout=5)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()
