"""A port for a listener that another process binds later (a c10d store, a test's server).

``bind(port 0)`` asks the kernel for a port from its ephemeral range, the range outgoing connections take
their local ports from too. On a busy machine one of them can take that port between the pick and the
listener's own bind, which then fails with EADDRINUSE (a gloo job's store did, in a test run with two
lanes). A port picked below that range can collide only with another listener's explicit bind.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default range
LOWEST = 20000  # above the well-known ports and most services' registered ones
NODE_PORTS = 30000
"""Where Kubernetes' NodePort range starts: on a Pod in the host's network (common on GPU nodes, for RDMA),
kube-proxy's rules would take a connection to a node's port there to a Service instead."""
TRIES = 64


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def below_ephemeral(low_ephemeral: int, *, tries: int = TRIES, rng: random.Random | None = None) -> list[int]:
    """Random ports to try below the ephemeral range (and the NodePorts); none where the range starts too low
    to leave room."""
    top = min(low_ephemeral, NODE_PORTS)
    if top - LOWEST < tries:
        return []
    pick = rng or random.Random()
    return [pick.randrange(LOWEST, top) for _ in range(tries)]


def free_port(host: str = "127.0.0.1", *, rng: random.Random | None = None) -> int:
    """A port free on ``host`` right now: below the ephemeral range where one is, else the kernel's pick."""
    for port in below_ephemeral(ephemeral_range()[0], rng=rng):
        with contextlib.suppress(OSError):  # taken: the next
            return _bind(host, port)
    return _bind(host, 0)


def _bind(host: str, port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, port))
        return int(s.getsockname()[1])
