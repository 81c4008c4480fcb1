"""Worker bootstrap: ``python -m phalanx.agent.bootstrap [--preimport M,..] --script|--module|--exec TARGET``.

Runs inside the worker process (so it may import torch). It pre-imports the heavy modules, then waits on
stdin for one JSON line ``{"env": {...}, "stack_file": "..."}`` carrying the worker's round; it then
installs a faulthandler on SIGUSR1 that dumps all threads' stacks to the stack file, instruments the
process (:mod:`phalanx.instrument`: steps and collectives without the script's help), and runs the target
exactly as ``python script.py args`` (or ``python -m module args``) would. This lets the agent keep warm
spares that have already paid for ``import torch`` when a round completes. End of input without a line
means the spare is not needed: exit 0 quietly.

With ``PHALANX_BOOTSTRAP_IMPORTS_FILE`` (warm spares under an agent) the spare also imports, once ready and
at idle priority, what the previous incarnation of the script recorded there, and the worker records what
its script imported for the next one (:mod:`phalanx.agent.script_imports`).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import json
import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import phalanx
from phalanx import instrument
from phalanx.agent import script_imports

_PR_SET_PDEATHSIG = 1
READY_ENV_VAR = "PHALANX_BOOTSTRAP_READY_FILE"
AGENT_PID_ENV_VAR = "PHALANX_AGENT_PID"


def die_with_parent(parent: int | None) -> None:
    """A worker must not outlive its agent (a killed node takes its workers with it). The death signal
    covers a parent that dies from now on; one that died before it was set shows as a parent that is not
    ``parent`` any more. The agent names its pid: in a container the agent is PID 1, so "my parent is init"
    would say nothing. A spare forked by the agent's zygote (:mod:`phalanx.agent.zygote`) dies with the
    zygote, which dies with the agent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def agent_pid() -> int | None:
    agent = os.environ.pop(AGENT_PID_ENV_VAR, "")
    return int(agent) if agent.isdigit() else None


def preimport_modules(names: str) -> None:
    for name in filter(None, names.split(",")):
        # A missing optional module only costs the speed-up.
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _receive() -> dict[str, Any] | None:
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return None
    data = json.loads(line)
    if not isinstance(data, dict):
        raise SystemExit("phalanx bootstrap: malformed hand-over")
    return data


def main(argv: list[str]) -> None:
    preimport = ""
    if argv[:1] == ["--preimport"]:
        preimport, argv = argv[1], argv[2:]
    die_with_parent(agent_pid())
    preimport_modules(preimport)
    run_spare(argv)


def run_spare(argv: list[str]) -> None:
    """The spare's life once its imports are done: tell the agent it is ready, wait for the round, run the
    target (``--script|--module|--exec TARGET args...``)."""
    mode, target, args = argv[0], argv[1], argv[2:]
    own_set = frozenset(sys.modules)  # what every spare has: a worker records only what its script added
    imports_file = os.environ.pop(script_imports.ENV_VAR, "")
    ready = os.environ.pop(READY_ENV_VAR, "")
    if ready:  # tells the agent this spare paid for its imports and can start at once
        with open(ready, "w") as f:
            f.write(str(os.getpid()))
    replayer = None
    if imports_file and mode != "--exec":
        # After the ready file: the agent never waits for these imports; only a spare still waiting gains.
        # With the script's own path (not the agent's working directory) first, as the script will have it:
        # a name resolves to the module the script would get.
        sys.path[0] = _path_entry(mode, target)
        replayer = script_imports.Replayer(Path(imports_file)).start()
    handover = _receive()
    if handover is None:
        os._exit(0)
    if replayer is not None:
        replayer.stop()
    os.environ.update({str(k): str(v) for k, v in handover["env"].items()})
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the hand-over pipe is done; the script reads stdin like under torchrun (nothing)
    os.close(devnull)
    stack_file = open(handover["stack_file"], "a")  # noqa: SIM115 - must stay open for the process' life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    if mode == "--exec":
        os.execvp(target, [target, *args])  # noqa: S606 - the user asked for --no-python
    phalanx.announce()  # the beacon at step -1: the agent and fault injection know the pid before any step
    instrument.install()  # steps and collectives without the script's help, unless it is off
    if mode == "--module":
        sys.argv = [target, *args]
        sys.path[0] = _path_entry(mode, target)
        _record(imports_file, own_set, own_names=[target])
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    sys.path[0] = _path_entry(mode, target)
    _record(imports_file, own_set)
    runpy.run_path(target, run_name="__main__")


def _path_entry(mode: str, target: str) -> str:
    """``sys.path[0]`` as ``python script.py`` (the script's directory) or ``python -m`` (the working
    directory) sets it."""
    return os.getcwd() if mode == "--module" else os.path.dirname(os.path.abspath(target))


def _record(imports_file: str, own_set: frozenset[str], own_names: list[str] | None = None) -> None:
    """Records, from a thread that waits for the script's first step, what the script imports; the script's
    own directory (``sys.path[0]``) and module are left out."""
    if not imports_file:
        return
    script_imports.Recorder(
        Path(imports_file),
        baseline=own_set,
        own_dirs=[sys.path[0]],
        own_names=own_names or [],
        beacon_path=os.environ.get("PHALANX_BEACON_FILE", ""),
    ).start()


if __name__ == "__main__":
    main(sys.argv[1:])
