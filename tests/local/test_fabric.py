"""The private network and the CPU cap of ``phalanx local``'s slow faults, on the real kernel: network
namespaces joined by a bridge, a ``tbf`` token bucket on a node's port, a cgroup's CFS quota."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.api.errors import ConfigError
from phalanx.local.cpulimit import CpuGroup, cpu_controller
from phalanx.local.fabric import Fabric

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PORT = 5000
RECEIVE = f"""
import socket, sys, time
srv = socket.create_server(("0.0.0.0", {PORT}))
print("listening", flush=True)
conn, _ = srv.accept()
total = 0
start = None
while data := conn.recv(1 << 16):
    start = start or time.monotonic()
    total += len(data)
print(total, time.monotonic() - start, flush=True)
"""
SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) as s:
    s.sendall(b"x" * int(sys.argv[3]))
"""


@pytest.fixture
def fab(namespaces: None) -> Iterator[Fabric]:
    f = Fabric()
    f.add_node(0)
    f.add_node(1)
    yield f
    f.close()


def transfer(fab: Fabric, *, sender: int, receiver: int, nbytes: int) -> float:
    """Seconds from the first byte received to the last, ``nbytes`` sent from one node to the other."""
    recv = subprocess.Popen(
        fab.nodes[receiver].enter([sys.executable, "-c", RECEIVE]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert recv.stdout is not None
        assert recv.stdout.readline() == "listening\n"
        subprocess.run(
            fab.nodes[sender].enter(
                [sys.executable, "-c", SEND, fab.nodes[receiver].address, str(PORT), str(nbytes)]
            ),
            check=True,
            timeout=30,
        )
        got, seconds = recv.stdout.readline().split()
        assert int(got) == nbytes
        return float(seconds)
    finally:
        recv.kill()
        recv.communicate()


def test_nodes_reach_each_other_over_the_switch_and_not_the_host(fab: Fabric) -> None:
    assert transfer(fab, sender=1, receiver=0, nbytes=1000) < 5
    with socket.create_server(("127.0.0.1", 0)) as host_listener:  # on the host's loopback
        port = host_listener.getsockname()[1]
        probe = subprocess.run(
            fab.nodes[1].enter([sys.executable, "-c", SEND, "127.0.0.1", str(port), "1"]),
            capture_output=True,
            text=True,
            check=False,
        )
    assert probe.returncode != 0
    assert "ConnectionRefusedError" in probe.stderr  # the node's loopback is its own


def test_a_throttled_node_sends_and_receives_at_its_rate(fab: Fabric) -> None:
    nbytes = 1 << 20  # 1 MiB: 1.05 s at 8 Mbit/s
    assert transfer(fab, sender=1, receiver=0, nbytes=nbytes) < 0.3
    fab.throttle(1, rate_bit_s=8_000_000)
    for sender, receiver in ((1, 0), (0, 1)):  # both directions of node-1's port
        seconds = transfer(fab, sender=sender, receiver=receiver, nbytes=nbytes)
        assert 0.7 < seconds < 3.0, (sender, receiver, seconds)
    fab.unthrottle(1)
    assert transfer(fab, sender=0, receiver=1, nbytes=nbytes) < 0.3


def test_removing_a_node_kills_what_is_left_in_its_namespace(fab: Fabric) -> None:
    # A process of its own session, as an orphaned probe is: not in the agent's process tree any more.
    left = subprocess.Popen(fab.nodes[1].enter(["sleep", "100"]), start_new_session=True)
    other = subprocess.Popen(fab.nodes[0].enter(["sleep", "100"]), start_new_session=True)
    try:
        # nsenter joins the namespace after Popen returns; the orphan of the real case is in it already.
        wait_in_namespace(left.pid, fab.nodes[1].holder.pid)
        wait_in_namespace(other.pid, fab.nodes[0].holder.pid)
        fab.remove_node(1)
        assert left.wait(timeout=5) == -9
        assert other.poll() is None  # another node's processes are not touched
    finally:
        for proc in (left, other):
            proc.kill()
            proc.wait()


def wait_in_namespace(pid: int, holder: int) -> None:
    netns = Path(f"/proc/{holder}/ns/net").readlink()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/ns/net").readlink() != netns:
        assert time.monotonic() < deadline, f"process {pid} never joined the namespace of {holder}"
        time.sleep(0.01)


def test_closing_the_fabric_ends_its_namespaces(namespaces: None) -> None:
    fab = Fabric()
    node = fab.add_node(3)
    assert node.address == "10.250.0.5"
    holders = [node.holder, fab._switch]
    netns = Path(f"/proc/{node.holder.pid}/ns/net").readlink()
    assert netns != Path("/proc/self/ns/net").readlink()
    fab.close()
    assert all(h.poll() is not None for h in holders)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 10 ms


def _cpu_share(pid: int, *, over_s: float) -> float:
    before, start = _cpu_seconds(pid), time.monotonic()
    time.sleep(over_s)
    return (_cpu_seconds(pid) - before) / (time.monotonic() - start)


def test_a_capped_group_gets_its_share_of_cpu_and_no_more(cgroups: None) -> None:
    group = CpuGroup(f"phalanx-test-{time.time_ns()}")
    busy = subprocess.Popen(group.wrap([sys.executable, "-c", "while True: pass"]))
    try:
        time.sleep(0.3)
        assert str(busy.pid) in (group.path / "cgroup.procs").read_text().split()
        group.limit(0.2)
        assert _cpu_share(busy.pid, over_s=2.0) < 0.3
        # The kernel held it back for the quota: how long depends on what the machine's load left the loop.
        assert group.throttled_s() > 0
        group.unlimit()
        time.sleep(0.2)  # the period the quota ran out in
        held = group.throttled_s()
        time.sleep(1.0)  # the loop runs as the load of the machine lets it, and the kernel no longer holds it
        assert group.throttled_s() == held
    finally:
        group.remove()  # kills what is left in it
        busy.wait(timeout=5)
    assert not group.path.exists()


def test_the_cpu_controller_is_found_in_either_cgroup_version(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "unified", tmp_path / "cpu,cpuacct"
    v2.mkdir()
    v1.mkdir()
    (v2 / "cgroup.controllers").write_text("memory pids\n")
    (v2 / "cgroup.subtree_control").write_text("")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    mounts = f"cgroup2 {v2} cgroup2 rw 0 0\ncgroup {v1} cgroup rw,cpu,cpuacct 0 0\n"
    assert cpu_controller(mounts) == (v1, 1)  # v2 without its cpu controller: v1's hierarchy
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    assert cpu_controller(mounts) == (v2, 2)
    assert (v2 / "cgroup.subtree_control").read_text() == "+cpu"  # enabled for the groups made below
    with pytest.raises(ConfigError, match="slow-cpu needs a cgroup cpu controller"):
        cpu_controller(f"cgroup {v1} cgroup rw,memory 0 0\n")
