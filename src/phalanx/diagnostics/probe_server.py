"""The warm probe process (``python -m phalanx.diagnostics.probe_server``, or a fork of the agent's zygote,
which has imported torch already): imports torch once, forks probes.

A probe started cold pays for ``import torch`` first, most of all on the node a probe round is looking for,
whose CPU is starved; and the round waits for its slowest node (see docs/benchmarks.md).
This server imports the probe programs (and so torch) once, then forks one child per request; the child
starts with torch already imported. It never runs a probe itself, so no probe leaves state behind for the
next one, and it never touches a GPU (a forked CUDA context is unusable; each child makes its own).

Protocol, one JSON object per line (:class:`phalanx.diagnostics.warm_probes.WarmProbes` is the client):

* request on stdin: ``{"argv": ["matmul", "--seconds", "2"], "stdout": PATH, "stderr": PATH, "env": {...}}``
  (``env``, optional: added to the child's environment; a store key travels there, never in ``argv``);
* replies on stdout: ``{"started": PID}`` once the child runs, then ``{"exited": PID, "code": C}`` (``C``
  as :func:`os.waitstatus_to_exitcode`: negative for a signal), or ``{"error": "..."}`` for a request it
  cannot read;
* the child runs :func:`phalanx.diagnostics.probe.main` in a session of its own (so that a timeout can kill
  its whole group), with stdin from /dev/null and stdout/stderr into the two files: the same program and the
  same output as ``python -m phalanx.diagnostics.probe ARGV``;
* one probe at a time; end of input ends the server.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from phalanx.diagnostics import probe


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()  # nothing may sit in the buffer at fork: the child would print it again


def _request(line: str) -> tuple[list[str], str, str, dict[str, str]]:
    data = json.loads(line)
    if not isinstance(data, dict):
        raise ValueError("a request is a JSON object")
    argv, out, err = data.get("argv"), data.get("stdout"), data.get("stderr")
    env = data.get("env", {})
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv must be a list of strings")
    if not isinstance(out, str) or not isinstance(err, str) or not out or not err:
        raise ValueError("stdout and stderr must be file paths")
    strings = isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    if not strings:
        raise ValueError("env must map strings to strings")
    return argv, out, err, env


def _child(argv: list[str], out: str, err: str, env: dict[str, str]) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        os.environ.update(env)
        os.setsid()
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        code = probe.main(argv)
    except SystemExit as exc:  # argparse's exit 2 on bad arguments
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            argv, out, err, env = _request(line)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            _reply({"error": f"bad request: {exc}"})
            continue
        pid = os.fork()
        if pid == 0:
            _child(argv, out, err, env)
        _reply({"started": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(serve())
