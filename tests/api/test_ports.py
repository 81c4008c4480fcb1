"""Ports for listeners that another process binds later: picked below the kernel's ephemeral range, where
outgoing connections cannot take them first (phalanx.api.ports)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
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


def test_a_taken_port_is_passed_over_for_the_next_pick(tmp_path: Path) -> None:
    low, _ = ports.ephemeral_range()
    first, second = ports.below_ephemeral(low, rng=random.Random(11))[:2]
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))  # another listener has the first pick
        held.listen()
        assert ports.free_port(rng=random.Random(11), ledger=tmp_path / "ports") == second


def test_a_port_held_in_the_ledger_or_followed_by_a_bound_one_is_passed_over() -> None:
    bound = {20001, 20011}
    free = lambda p: p not in bound  # noqa: E731
    assert ports.choose([20000, 20002], {20000: 1.0}, span=1, free=free) == 20002  # held
    assert ports.choose([20000, 20002], {20003: 1.0}, span=2, free=free) is None  # the block's second held
    assert ports.choose([20010, 20020], {}, span=2, free=free) == 20020  # 20011 is bound
    assert ports.choose([20001], {}, span=1, free=free) is None


def test_the_ledger_keeps_what_is_still_held_and_drops_malformed_lines() -> None:
    text = "20000 105.000\n20001 95.000\ngarbage\n20002 nan-ish\n20003 200.5\n"
    held = ports.parse_ledger(text, now=100.0)
    assert held == {20000: 105.0, 20003: 200.5}
    assert ports.parse_ledger(ports.format_ledger(held), now=100.0) == held


def test_a_port_picked_by_one_process_is_not_picked_by_another_until_its_hold_ends(tmp_path: Path) -> None:
    ledger = tmp_path / "ports"
    # Every process draws the same candidates: without the ledger all would get the first free one.
    script = (
        "import random, sys; from pathlib import Path; from phalanx.api import ports;"
        "print(ports.free_port(span=2, rng=random.Random(3), ledger=Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(ledger)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    picked = [int(p.communicate(timeout=60)[0]) for p in procs]
    blocks = [{port, port + 1} for port in picked]
    assert len(set().union(*blocks)) == 8, picked  # four blocks of two, none shared
    held = ports.parse_ledger(ledger.read_text(), now=time.time())
    assert set(held) == set().union(*blocks)
    assert all(until <= time.time() + ports.HOLD_S for until in held.values())


def test_picks_go_on_without_a_ledger_in_a_folder_others_may_enter(tmp_path: Path) -> None:
    """The ledger lives in this user's private folder, made 0700 when missing; one that others may enter
    (planted, or loosened) is not used: a pick goes on without it and writes nothing there."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    port = ports.free_port(ledger=shared / "ports")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert list(shared.iterdir()) == []
    made = tmp_path / "made"
    ports.free_port(ledger=made / "ports")
    assert made.stat().st_mode & 0o777 == 0o700
    assert (made / "ports").stat().st_mode & 0o777 == 0o600
    assert ports.LEDGER.parent.name == f"phalanx-{os.geteuid()}", "the default is this user's folder"


def test_a_ledger_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "ports").symlink_to(victim)
    ports.free_port(ledger=tmp_path / "ports")
    assert victim.read_text() == "precious\n"


def test_a_ledger_locked_by_a_stopped_process_delays_a_pick_by_the_wait_only(tmp_path: Path) -> None:
    ledger = tmp_path / "ports"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, "
         "fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(ledger)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "locked\n"
        start = time.monotonic()
        port = ports.free_port(ledger=ledger)
        assert ports.LOCK_WAIT_S <= time.monotonic() - start < ports.LOCK_WAIT_S + 5
        assert ledger.read_text() == ""  # nothing written without the lock
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    finally:
        holder.kill()
        holder.communicate()
