"""Faults the scenarios inject from inside a container, with what any cluster offers (``kubectl exec``)."""

from __future__ import annotations

KILL_ONE_RANK = """
import os, signal, time

def training(pid):
    # A training process has the script in its command line and has been handed its round: its stdin is
    # /dev/null. A warm spare still waits on a pipe for a round, and killing it costs training nothing.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"/opt/tiny/train.py" in f.read() and os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    except OSError:
        return False

ranks = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and training(p))
os.kill(ranks[-1], signal.SIGKILL)
print(ranks[-1], time.time())
"""
"""Python that SIGKILLs one training process of examples/elasticjob.yaml where it runs, and prints its pid
and the time of the kill."""
