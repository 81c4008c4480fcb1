"""Processes of the local cluster: the master and the node agents, and how faults are dealt to them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from phalanx.api import beacon
from phalanx.api.errors import PhalanxError


def open_log(path: Path) -> IO[bytes]:
    """A job log opened for appending, readable by its owner only (0600): worker output may hold the job's
    data; a log left by an older version is made owner-only too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def private_dir(path: Path) -> Path:
    """Creates ``path`` owner-only (0700) when it does not exist yet; one that exists is left as it is."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@dataclass
class MasterProc:
    """``phalanx master`` as a subprocess; restarted on the same ports and state after a kill."""

    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    grpc_addr: str = ""
    http_addr: str = ""

    def start(self) -> None:
        args = list(self.args)
        if self.grpc_addr:  # a restart: same ports, so agents and the HTTP poller find it again
            args = _replace(args, "--port", self.grpc_addr.rsplit(":", 1)[1])
            args = _replace(args, "--http-port", self.http_addr.rsplit(":", 1)[1])
        with open_log(self.log) as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "phalanx", "master", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        values: dict[str, str] = {}
        for _ in range(2):
            line = self.proc.stdout.readline().decode().strip()
            key, _, value = line.partition("=")
            values[key] = value
        if "PHALANX_MASTER_GRPC" not in values or "PHALANX_MASTER_HTTP" not in values:
            self.kill()
            raise PhalanxError(f"the master did not start; its log is {self.log}")
        self.grpc_addr, self.http_addr = values["PHALANX_MASTER_GRPC"], values["PHALANX_MASTER_HTTP"]
        # Keep draining stdout into the log, so the master never blocks on a full pipe nor dies of EPIPE.
        threading.Thread(target=_drain, args=(self.proc.stdout, self.log), daemon=True).start()

    def kill(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            self.proc.wait()


def _drain(pipe: IO[bytes], log: Path) -> None:
    with pipe, open_log(log) as out:
        for line in iter(pipe.readline, b""):
            out.write(line)
            out.flush()


def _replace(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


@dataclass
class NodeProc:
    """One node: a ``phalanx-run`` agent and, through it, its workers."""

    index: int
    node_id: str
    proc: subprocess.Popen[bytes]
    log: Path
    started_at: float
    killed: bool = False
    evicted: bool = False

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def start_node(
    *, index: int, node_id: str, argv: list[str], log: Path, env: dict[str, str], now: float
) -> NodeProc:
    with open_log(log) as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return NodeProc(index=index, node_id=node_id, proc=proc, log=log, started_at=now)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in tree.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILLs a process, its process group and every descendant (workers run in their own groups)."""
    victims = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in [pid, *victims]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def read_beacon(path: Path) -> beacon.Beacon | None:
    try:
        reader = beacon.BeaconReader(path)
    except (OSError, ValueError):
        return None
    try:
        return reader.read()
    except RuntimeError:
        return None
    finally:
        reader.close()
