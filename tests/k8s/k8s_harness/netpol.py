"""NetworkPolicies enforced on the container nodes: kube-router's firewall, with its routing and service proxy
off. The CNI bridge plugin enforces no policy by itself, so without it every NetworkPolicy phalanx makes would
be an object no test could see work.

Only the **first node's Pods** are guarded. kube-router guards the Pods of the node it runs for (those
whose ``status.hostIP`` is that node's address) and owns the filter table's ``KUBE-ROUTER-*``,
``KUBE-POD-FW-*`` and ``KUBE-NWPLCY-*`` chains and its ``KUBE-SRC-*``/``KUBE-DST-*`` ipsets outright: the
nodes here share one network namespace, and a second instance would remove the first one's rules as stale.
Traffic from the machine itself (the kubelets' probes, the tests) is always let in (its rule for a Pod's own
node matches every local address).

A test that needs a Pod guarded places it on the first node (``nodes.names[0]``, where the operator runs
too). kube-router's own ``--cleanup-config`` crashes in its service proxy's clean-up, so
:func:`remove_rules` takes its rules and sets away itself.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

CHAIN_PREFIXES = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")
SET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-")
PARENT_CHAINS = ("INPUT", "FORWARD", "OUTPUT")


def argv(binary: Path, *, kubeconfig: Path, node: str, service_cidr: str, health_port: int) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--enable-cni=false",
        f"--hostname-override={node}",
        f"--service-cluster-ip-range={service_cidr}",
        "--metrics-port=0",
        f"--health-port={health_port}",
    ]


def enforcing() -> bool:
    """Whether kube-router has made its chains and hooked them into the filter table (its first sync)."""
    rules = _iptables("-S", "FORWARD")
    return any("-j KUBE-ROUTER-FORWARD" in line for line in rules)


def remove_rules() -> None:
    """Removes what kube-router put into the filter table and ipset (after it was stopped, or killed with a
    run before its clean-up)."""
    for parent in PARENT_CHAINS:
        for line in _iptables("-S", parent):
            words = shlex.split(line)
            if words[:1] == ["-A"] and any(w.startswith(CHAIN_PREFIXES) for w in words):
                subprocess.run(["iptables", "-D", *words[1:]], capture_output=True, check=False)
    chains = [line.split()[1] for line in _iptables("-S") if line.startswith("-N ")]
    ours = [c for c in chains if c.startswith(CHAIN_PREFIXES)]
    for flag in ("-F", "-X"):  # every chain emptied before any is deleted: they jump to each other
        for chain in ours:
            subprocess.run(["iptables", flag, chain], capture_output=True, check=False)
    listed = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, check=False)
    for name in listed.stdout.split():
        if name.startswith(SET_PREFIXES):
            subprocess.run(["ipset", "destroy", name], capture_output=True, check=False)


def _iptables(*args: str) -> list[str]:
    done = subprocess.run(["iptables", *args], capture_output=True, text=True, check=False)
    return done.stdout.splitlines() if done.returncode == 0 else []
