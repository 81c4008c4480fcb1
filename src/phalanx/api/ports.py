"""A port for a listener that another process binds later (a c10d store, a test's server).

``bind(port 0)`` asks the kernel for a port from its ephemeral range, the range outgoing connections take
their local ports from too. On a busy machine one of them can take that port between the pick and the
listener's own bind, which then fails with EADDRINUSE (a gloo job's store did, in a test run with two
lanes). A port picked below that range can collide only with another listener's explicit bind.

Such a bind is most often another pick of this module's: two processes that each found the same port free
and both bind it later (a probe's store lost its port so, in a test run with two lanes). Every pick is
therefore written to a ledger in the machine's temporary folder, under a lock, and a port picked in the
last ``HOLD_S`` seconds is not handed out again. The ledger is shared by every process of the machine (or
the container) that picks through here; where it cannot be opened, picks go on without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default range
LOWEST = 20000  # above the well-known ports and most services' registered ones
NODE_PORTS = 30000
"""Where Kubernetes' NodePort range starts: on a Pod in the host's network (common on GPU nodes, for RDMA),
kube-proxy's rules would take a connection to a node's port there to a Service instead."""
TRIES = 64
LEDGER = Path(tempfile.gettempdir()) / f"phalanx-{os.geteuid()}" / "ports"
"""In this user's private folder (0700, beside the checkpoint hosts' sockets): a ledger every user of the
machine could open would let any of them hold every port, or its lock, against everyone else's picks."""
LOCK_WAIT_S = 2.0  # a pick holds the lock for well under a millisecond
HOLD_S = 120.0
"""How long a picked port stays reserved: far above the time from a pick to its listener's bind (a
rendezvous round's store, a probe's), and short enough that the ledger holds a few hundred ports at most
out of the ten thousand it picks from."""


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


def choose(
    candidates: Iterable[int], held: Mapping[int, float], *, span: int, free: Callable[[int], bool]
) -> int | None:
    """The first candidate whose ``span`` ports from it on are neither held in the ledger nor bound now."""
    for port in candidates:
        block = range(port, port + span)
        if not any(p in held for p in block) and all(free(p) for p in block):
            return port
    return None


def parse_ledger(text: str, *, now: float) -> dict[int, float]:
    """The ledger's ports still held at ``now`` (port -> until when); a malformed line is dropped."""
    held: dict[int, float] = {}
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            port, until = line.split()
            if float(until) > now:
                held[int(port)] = float(until)
    return held


def format_ledger(held: Mapping[int, float]) -> str:
    return "".join(f"{port} {until:.3f}\n" for port, until in sorted(held.items()))


def free_port(
    host: str = "127.0.0.1",
    *,
    span: int = 1,
    rng: random.Random | None = None,
    ledger: Path = LEDGER,
) -> int:
    """A port free on ``host`` right now, and the ``span - 1`` ports after it: below the ephemeral range where
    one is, not picked by another process in the last ``HOLD_S`` seconds; else the kernel's pick."""
    candidates = below_ephemeral(ephemeral_range()[0], rng=rng)
    now = time.time()
    with _ledger(ledger, now=now) as held:
        port = choose(candidates, held, span=span, free=lambda p: _bindable(host, p))
        if port is not None:
            until = now + HOLD_S
            held.update({p: until for p in range(port, port + span)})
            return port
    return _kernel_pick(host, span)


@contextlib.contextmanager
def _ledger(path: Path, *, now: float) -> Iterator[dict[int, float]]:
    """The ledger's held ports, locked against every other picker until the block ends and written back.
    An empty one, kept nowhere, where the file cannot be opened (another user's, or a link: a link planted in
    the shared folder would have this process write over whatever it points at)."""
    try:
        _private_folder(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield {}
        return
    with os.fdopen(fd, "r+") as f:
        if not _lock(f.fileno()):
            yield {}
            return
        held = parse_ledger(f.read(), now=now)
        yield held
        f.seek(0)
        f.truncate()
        f.write(format_ledger(held))


def _private_folder(path: Path) -> None:
    """Makes ``path`` (0700) or checks that it is this user's own folder that nobody else may enter; OSError
    otherwise (another user's, or a link planted in its place)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not this user's private folder")


def _lock(fd: int) -> bool:
    """Locks the ledger (released when the file closes); False after ``LOCK_WAIT_S``: a holder stopped
    (SIGSTOP) or stuck while it held the lock would otherwise stop every picker of the machine."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def _kernel_pick(host: str, span: int) -> int:
    for _ in range(TRIES):
        port = _bind(host, 0)
        if all(_bindable(host, p) for p in range(port + 1, port + span)):
            return port
    return _bind(host, 0)


def _bindable(host: str, port: int) -> bool:
    try:
        _bind(host, port)
    except OSError:
        return False
    return True


def _bind(host: str, port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, port))
        return int(s.getsockname()[1])
