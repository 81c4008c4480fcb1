"""``phalanx-run`` command line: torchrun's flags plus phalanx's own, parsed into an :class:`AgentConfig`.

Every value the agent can be given is a field of :class:`~phalanx.api.settings.AgentSettings`, the one table:
a flag wins over its ``PHALANX_*`` variable, a variable over the table's default, and a flag's help is the
field's doc. What is left here is what one launch runs (the script, its arguments, the node range).

torchrun flags that have no meaning here (``--rdzv-backend``, ``--node-rank``, ``--master-addr``,
``--master-port``, ``--start-method``) are accepted so existing launch lines keep working; the ones that
could surprise a user are noted on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.api.errors import ConfigError
from phalanx.api.settings import AgentSettings, describe, from_env, parse_duration, parse_node_range


@dataclass(frozen=True, kw_only=True)
class AgentConfig(AgentSettings):
    """The agent's settings, resolved from flags and environment, and what this launch runs."""

    min_nodes: int
    max_nodes: int
    standalone: bool
    exit_with_parent: bool
    role: str
    module: bool
    no_python: bool
    script: str
    script_args: list[str]
    notes: list[str] = field(default_factory=list)


def _doc(path: str) -> str:
    """The help text of a flag: the doc line of its settings field (``hang.floor_s``: a nested one)."""
    cls: Any = AgentSettings
    *groups, name = path.split(".")
    for group in groups:
        cls = next(f.default_factory for f in dataclasses.fields(cls) if f.name == group)
    return describe(next(f for f in dataclasses.fields(cls) if f.name == name))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phalanx-run",
        description="Node agent of phalanx; a drop-in replacement for torchrun.",
        allow_abbrev=False,
    )
    add = p.add_argument
    # Flags of settings fields default to None: unset, the field's PHALANX_* variable or default applies.
    add("--nnodes", default="1:1", help="Number of nodes, N or MIN:MAX.")
    add("--nproc-per-node", "--nproc_per_node", help=_doc("nproc_per_node") + "; also cpu or auto.")
    add("--max-restarts", "--max_restarts", type=int, help=_doc("max_restarts"))
    add("--monitor-interval", "--monitor_interval", help=_doc("monitor_interval_s"))
    add("--rdzv-endpoint", "--rdzv_endpoint", help=_doc("master_addr"))
    add("--rdzv-id", "--rdzv_id", help=_doc("job_id"))
    add("--rdzv-backend", "--rdzv_backend", default="phalanx", help="Accepted for torchrun compatibility.")
    add("--rdzv-conf", "--rdzv_conf", default="", help="Accepted for torchrun compatibility.")
    add("--standalone", action="store_true", help="Start a master for a single-node job.")
    add(
        "--exit-with-parent",
        action="store_true",
        help="Leave the job as on SIGTERM once the process that started this agent exits, even by SIGKILL "
        "(phalanx local starts its agents so).",
    )
    add("--log-dir", "--log_dir", help=_doc("log_dir"))
    add("--redirects", "-r", default="0", help="Accepted; output is always captured per rank.")
    add("--tee", "-t", default="0", help="Accepted; output is always echoed with a [rankN]: prefix.")
    add("--node-rank", "--node_rank", default=None, help="Ignored: group ranks come from the rendezvous.")
    add("--master-addr", "--master_addr", default=None, help="Ignored: each round picks its store address.")
    add("--master-port", "--master_port", default=None, help="Ignored: each round picks a fresh port.")
    add("--role", default="default", help="Worker role name.")
    add("--start-method", "--start_method", default="spawn", help="Accepted for torchrun compatibility.")
    add("--local-addr", "--local_addr", help=_doc("host"))
    add("-m", "--module", action="store_true", help="Run the script as a Python module (python -m).")
    add("--no-python", "--no_python", action="store_true", help="Run the script as an executable.")
    add("--node-id", help=_doc("node_id"))
    add("--token-file", help=_doc("token_file"))
    add("--grace-period", help=_doc("grace_period_s"))
    add("--hang-floor", help=_doc("hang.floor_s"))
    add("--hang-idle-floor", help=_doc("hang.idle_floor_s"))
    add("--hang-stopped", help=_doc("hang.stopped_s"))
    add("--hang-factor", help=_doc("hang.factor"))
    add("--hang-startup", help=_doc("hang.startup_s"))
    add("--no-hang-detection", action="store_true", help="Do not detect hung workers.")
    add("--no-warm-spares", action="store_true", help="Start workers cold instead of from pre-warmed spares.")
    add(
        "--no-instrument",
        action="store_true",
        help=_doc("hang.instrument") + " This flag turns it off.",
    )
    add(
        "--no-warm-probes",
        action="store_true",
        help="Start each health probe cold, not forked from a probe server that has imported torch.",
    )
    add("--checkpoint-dir", help=_doc("checkpoint.storage_path"))
    add("--checkpoint-keep-last", type=int, help=_doc("checkpoint.keep_last"))
    add("--no-checkpoint-host", action="store_true", help="Do not run a flash-checkpoint host on this node.")
    add("training_script", help="Script (or module with -m, executable with --no-python) to run.")
    add("training_script_args", nargs=argparse.REMAINDER)
    return p


def _nproc(text: str) -> int:
    if text in ("cpu",):
        return os.cpu_count() or 1
    if text in ("auto", "gpu"):
        return 1  # the agent never imports torch to count devices; pass a number on GPU machines
    try:
        value = int(text)
    except ValueError as exc:
        raise ConfigError(f"expected a number, cpu or auto, got {text!r}", field="nproc-per-node") from exc
    if value < 1:
        raise ConfigError(f"must be at least 1, got {value}", field="nproc-per-node")
    return value


def _default_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _given(**values: Any) -> dict[str, Any]:
    """The flags that were given (argparse leaves the others None)."""
    return {name: value for name, value in values.items() if value is not None}


def _from_flags(args: argparse.Namespace, env: Mapping[str, str]) -> AgentSettings:
    """The table's values: flags over ``PHALANX_*`` variables over defaults."""
    base = from_env(AgentSettings, env)
    duration = {
        name: parse_duration(text, name=flag) if text is not None else None
        for name, flag, text in (
            ("floor_s", "hang-floor", args.hang_floor),
            ("idle_floor_s", "hang-idle-floor", args.hang_idle_floor),
            ("stopped_s", "hang-stopped", args.hang_stopped),
            ("startup_s", "hang-startup", args.hang_startup),
        )
    }
    hang = dataclasses.replace(
        base.hang,
        **_given(
            enabled=False if args.no_hang_detection else None,
            instrument=False if args.no_instrument else None,
            factor=float(args.hang_factor) if args.hang_factor is not None else None,
            **duration,
        ),
    )
    checkpoint = dataclasses.replace(
        base.checkpoint, **_given(storage_path=args.checkpoint_dir, keep_last=args.checkpoint_keep_last)
    )
    return dataclasses.replace(
        base,
        hang=hang,
        checkpoint=checkpoint,
        **_given(
            job_id=args.rdzv_id or None,
            node_id=args.node_id,
            master_addr=args.rdzv_endpoint,
            token_file=args.token_file,
            host=args.local_addr,
            nproc_per_node=_nproc(str(args.nproc_per_node)) if args.nproc_per_node is not None else None,
            max_restarts=args.max_restarts,
            monitor_interval_s=parse_duration(args.monitor_interval, name="monitor-interval")
            if args.monitor_interval is not None
            else None,
            grace_period_s=parse_duration(args.grace_period, name="grace-period")
            if args.grace_period is not None
            else None,
            log_dir=args.log_dir,
            warm_spares=False if args.no_warm_spares else None,
            warm_probes=False if args.no_warm_probes else None,
            checkpoint_host=False if args.no_checkpoint_host else None,
        ),
    )


def parse(argv: Sequence[str], env: Mapping[str, str]) -> AgentConfig:
    """Parses a ``phalanx-run`` command line; ``env`` supplies the ``PHALANX_*`` values flags do not give."""
    args = build_parser().parse_args(list(argv))
    settings = _from_flags(args, env)
    notes: list[str] = []
    min_nodes, max_nodes = parse_node_range(args.nnodes, name="nnodes")
    if args.node_rank is not None:
        notes.append("--node-rank is ignored: phalanx assigns group ranks at each rendezvous")
    if args.master_addr is not None or args.master_port is not None:
        notes.append("--master-addr/--master-port are ignored: each round gets a fresh store address")
    if args.standalone:
        if settings.master_addr:
            notes.append("--standalone starts its own master; --rdzv-endpoint is ignored")
        min_nodes = max_nodes = 1
    elif not settings.master_addr:
        raise ConfigError(
            "give the master's host:port with --rdzv-endpoint, or use --standalone", field="rdzv-endpoint"
        )
    script_args = list(args.training_script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    resolved = {f.name: getattr(settings, f.name) for f in dataclasses.fields(AgentSettings)}
    return AgentConfig(
        **{
            **resolved,
            "job_id": settings.job_id or ("standalone" if args.standalone else "none"),
            "node_id": settings.node_id or socket.gethostname(),
            "host": settings.host or _default_host(),
        },
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        standalone=args.standalone,
        exit_with_parent=args.exit_with_parent,
        role=args.role,
        module=args.module,
        no_python=args.no_python,
        script=args.training_script,
        script_args=script_args,
        notes=notes,
    )


def print_notes(config: AgentConfig) -> None:
    for note in config.notes:
        print(f"phalanx-run: note: {note}", file=sys.stderr)
