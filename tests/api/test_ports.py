"""Ports for listeners that another process binds later: picked below the kernel's ephemeral range, where
outgoing connections cannot take them first (phalanx.api.ports)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from phalanx.api import ports


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    given = tmp_path / "range"
    given.write_text("40000\t50000\n")
    assert ports.ephemeral_range(given) == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL
    given.write_text("garbage\n")
    assert ports.ephemeral_range(given) == ports.DEFAULT_EPHEMERAL


def test_candidates_lie_below_the_ephemeral_range_and_none_when_it_starts_too_low() -> None:
    picks = ports.below_ephemeral(32768, rng=random.Random(7))
    assert len(picks) == ports.TRIES
    assert all(ports.LOWEST <= p < ports.NODE_PORTS for p in picks)  # nor Kubernetes' NodePorts
    assert ports.below_ephemeral(ports.LOWEST + 10) == []


def test_a_free_port_is_below_the_range_and_a_listener_can_bind_it() -> None:
    low, _ = ports.ephemeral_range()
    port = ports.free_port()
    if min(low, ports.NODE_PORTS) - ports.LOWEST >= ports.TRIES:
        assert ports.LOWEST <= port < min(low, ports.NODE_PORTS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_taken_port_is_passed_over_for_the_next_pick() -> None:
    low, _ = ports.ephemeral_range()
    first, second = ports.below_ephemeral(low, rng=random.Random(11))[:2]
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))  # another listener has the first pick
        held.listen()
        assert ports.free_port(rng=random.Random(11)) == second
