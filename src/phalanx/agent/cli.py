"""``phalanx-run``: parse torchrun's command line, find (or start) the master, and run the supervisor."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO

from phalanx.agent import config as agent_config
from phalanx.agent.client import MasterClient
from phalanx.agent.outcomes import Terminated
from phalanx.agent.supervisor import Supervisor
from phalanx.api.errors import ConfigError, PhalanxError


def _drain(pipe: IO[bytes]) -> None:
    with pipe:
        for _ in iter(pipe.readline, b""):
            pass


class StandaloneMaster:
    """A ``phalanx master`` subprocess for ``--standalone``, with a generated token."""

    def __init__(self, *, job_id: str, workdir: Path, max_restarts: int) -> None:
        self.token = secrets.token_hex(24)
        self.token_file = workdir / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        log = (workdir / "master.log").open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "phalanx", "master",
                "--job-id", job_id, "--nodes", "1:1", "--port", "0", "--http-port", "0",
                "--token-file", str(self.token_file), "--state", str(workdir / "master-state.json"),
                "--max-restarts", str(max_restarts), "--exit-with-parent",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )  # fmt: skip
        log.close()  # the master holds its own descriptor
        assert self.proc.stdout is not None
        lines = [self.proc.stdout.readline().decode().strip() for _ in range(2)]
        values = dict(line.split("=", 1) for line in lines if "=" in line)
        if "PHALANX_MASTER_GRPC" not in values:
            self.stop()
            raise PhalanxError(f"the standalone master did not start; see {workdir / 'master.log'}")
        self.grpc_addr = values["PHALANX_MASTER_GRPC"]
        # Keep draining stdout, so the master never blocks on a full pipe nor dies of EPIPE.
        threading.Thread(target=_drain, args=(self.proc.stdout,), daemon=True).start()

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


PARENT_POLL_S = 0.5


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)  # the supervisor persists the newest checkpoint, then cleans up


def _exit_with_parent(parent: int) -> None:
    """Sends this agent SIGTERM once ``parent`` is no longer its parent: the process that started it exited,
    even by SIGKILL, and this process was re-parented. The agent then leaves as on any SIGTERM (persisting
    first), so a job that ``phalanx local`` started never trains on unwatched after it."""

    def watch() -> None:
        while os.getppid() == parent:  # polled: Linux tells a process nothing when its parent dies
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _job_id_for_standalone(job_id: str) -> str:
    return job_id if job_id not in ("", "none", "standalone") else f"standalone-{secrets.token_hex(3)}"


def run_agent(argv: list[str]) -> int:
    """Runs ``phalanx-run`` with the given arguments; returns the exit code."""
    try:
        cfg = agent_config.parse(argv, os.environ)
    except ConfigError as exc:
        print(f"phalanx-run: error: {exc}", file=sys.stderr)
        return 2
    agent_config.print_notes(cfg)
    signal.signal(signal.SIGTERM, _terminate)
    if cfg.exit_with_parent:
        _exit_with_parent(os.getppid())
    with tempfile.TemporaryDirectory(prefix="phalanx-run-") as tmp:
        workdir = Path(tmp)
        master: StandaloneMaster | None = None
        try:
            if cfg.standalone:
                job_id = _job_id_for_standalone(cfg.job_id)
                master = StandaloneMaster(job_id=job_id, workdir=workdir, max_restarts=cfg.max_restarts)
                cfg = dataclasses.replace(
                    cfg,
                    job_id=job_id,
                    master_addr=master.grpc_addr,
                    # the checkpoint host reads the token from this file to report checkpoints
                    token_file=str(master.token_file),
                )
                token = master.token
            else:
                if not cfg.token_file:
                    raise ConfigError(
                        "give the job token with --token-file or PHALANX_TOKEN_FILE", field="token-file"
                    )
                try:
                    token = Path(cfg.token_file).read_text().strip()
                except OSError as exc:
                    raise ConfigError(f"cannot read the token file: {exc}", field="token-file") from exc
            log_dir = Path(cfg.log_dir) if cfg.log_dir else workdir / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            client = MasterClient(address=cfg.master_addr, token=token)
            try:
                return Supervisor(cfg, client=client, base_env=os.environ, log_dir=log_dir).run()
            finally:
                client.close()
        except PhalanxError as exc:
            print(f"phalanx-run: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        except Terminated as exc:  # before the supervisor ran
            return 128 + exc.signum
        finally:
            if master is not None:
                master.stop()
