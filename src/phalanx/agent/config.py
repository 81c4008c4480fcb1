"""``phalanx-run`` command line: torchrun's flags plus phalanx's own, parsed into an :class:`AgentConfig`.

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

from phalanx.api.errors import ConfigError
from phalanx.api.settings import (
    CheckpointSettings,
    HangSettings,
    LogSettings,
    from_env,
    parse_duration,
    parse_node_range,
)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything the agent needs, resolved from flags and environment."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    monitor_interval_s: float
    master_addr: str
    standalone: bool
    job_id: str
    node_id: str
    host: str
    token_file: str
    log_dir: str
    role: str
    module: bool
    no_python: bool
    script: str
    script_args: list[str]
    grace_period_s: float
    warm_spares: bool
    warm_probes: bool = True
    checkpoint_host: bool = True
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    hang: HangSettings = field(default_factory=HangSettings)
    logs: LogSettings = field(default_factory=LogSettings)
    notes: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phalanx-run",
        description="Node agent of phalanx; a drop-in replacement for torchrun.",
        allow_abbrev=False,
    )
    add = p.add_argument
    add("--nnodes", default="1:1", help="Number of nodes, N or MIN:MAX.")
    add("--nproc-per-node", "--nproc_per_node", default="1", help="Processes per node (int, cpu or auto).")
    add("--max-restarts", "--max_restarts", type=int, default=0, help="Worker restarts before failing.")
    add("--monitor-interval", "--monitor_interval", default="0.1", help="Worker check interval, seconds.")
    add("--rdzv-endpoint", "--rdzv_endpoint", default="", help="host:port of the phalanx master (gRPC).")
    add("--rdzv-id", "--rdzv_id", default="", help="Job id.")
    add("--rdzv-backend", "--rdzv_backend", default="phalanx", help="Accepted for torchrun compatibility.")
    add("--rdzv-conf", "--rdzv_conf", default="", help="Accepted for torchrun compatibility.")
    add("--standalone", action="store_true", help="Start a master for a single-node job.")
    add("--log-dir", "--log_dir", default="", help="Directory for per-rank logs and error files.")
    add("--redirects", "-r", default="0", help="Accepted; output is always captured per rank.")
    add("--tee", "-t", default="0", help="Accepted; output is always echoed with a [rankN]: prefix.")
    add("--node-rank", "--node_rank", default=None, help="Ignored: group ranks come from the rendezvous.")
    add("--master-addr", "--master_addr", default=None, help="Ignored: each round picks its store address.")
    add("--master-port", "--master_port", default=None, help="Ignored: each round picks a fresh port.")
    add("--role", default="default", help="Worker role name.")
    add("--start-method", "--start_method", default="spawn", help="Accepted for torchrun compatibility.")
    add("--local-addr", "--local_addr", default=None, help="Address other nodes reach this node at.")
    add("-m", "--module", action="store_true", help="Run the script as a Python module (python -m).")
    add("--no-python", "--no_python", action="store_true", help="Run the script as an executable.")
    add("--node-id", default=None, help="Node id (default: $PHALANX_NODE_ID or the host name).")
    add("--token-file", default=None, help="Job token file (default: $PHALANX_TOKEN_FILE).")
    add("--grace-period", default="5", help="Time between SIGTERM and SIGKILL when stopping workers.")
    add(
        "--hang-floor",
        default=None,
        help="Shortest wait in a recorded collective or on GPU work that counts as a hang (default 10s).",
    )
    add(
        "--hang-idle-floor",
        default=None,
        help="Shortest silence outside any recorded collective, or of a beacon alone, that counts as a hang "
        "(default 60s).",
    )
    add(
        "--hang-factor", default=None, help="Multiple of the p99 step interval after which a beacon is stale."
    )
    add("--hang-startup", default=None, help="Time allowed before the first reported step.")
    add("--no-hang-detection", action="store_true", help="Do not detect hung workers.")
    add("--no-warm-spares", action="store_true", help="Start workers cold instead of from pre-warmed spares.")
    add(
        "--no-warm-probes",
        action="store_true",
        help="Start each health probe cold, not forked from a probe server that has imported torch.",
    )
    add(
        "--checkpoint-dir",
        default=None,
        help="Where the node's checkpoint host persists flash checkpoints: a directory or s3://BUCKET/PREFIX.",
    )
    add("--checkpoint-keep-last", type=int, default=None, help="Committed checkpoint steps kept on storage.")
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


def parse(argv: Sequence[str], env: Mapping[str, str]) -> AgentConfig:
    """Parses a ``phalanx-run`` command line; ``env`` supplies PHALANX_* defaults."""
    args = build_parser().parse_args(list(argv))
    notes: list[str] = []
    min_nodes, max_nodes = parse_node_range(args.nnodes, name="nnodes")
    if args.node_rank is not None:
        notes.append("--node-rank is ignored: phalanx assigns group ranks at each rendezvous")
    if args.master_addr is not None or args.master_port is not None:
        notes.append("--master-addr/--master-port are ignored: each round gets a fresh store address")
    if args.standalone:
        if args.rdzv_endpoint:
            notes.append("--standalone starts its own master; --rdzv-endpoint is ignored")
        min_nodes = max_nodes = 1
    elif not args.rdzv_endpoint:
        raise ConfigError(
            "give the master's host:port with --rdzv-endpoint, or use --standalone", field="rdzv-endpoint"
        )
    hang_values = HangSettings()
    hang = HangSettings(
        enabled=not args.no_hang_detection,
        floor_s=parse_duration(args.hang_floor, name="hang-floor")
        if args.hang_floor
        else hang_values.floor_s,
        idle_floor_s=parse_duration(args.hang_idle_floor, name="hang-idle-floor")
        if args.hang_idle_floor
        else hang_values.idle_floor_s,
        factor=float(args.hang_factor) if args.hang_factor else hang_values.factor,
        startup_s=parse_duration(args.hang_startup, name="hang-startup")
        if args.hang_startup
        else hang_values.startup_s,
    )
    if args.max_restarts < 0:
        raise ConfigError(f"cannot be negative, got {args.max_restarts}", field="max-restarts")
    job_id = args.rdzv_id or env.get("PHALANX_JOB_ID", "")
    if not job_id:
        job_id = "standalone" if args.standalone else "none"
    # PHALANX_CHECKPOINT_STORAGE_PATH / _KEEP_LAST give the defaults; flags win.
    ckpt = from_env(CheckpointSettings, env, prefix="PHALANX_CHECKPOINT_")
    overrides: dict[str, object] = {}
    if args.checkpoint_dir is not None:
        overrides["storage_path"] = args.checkpoint_dir
    if args.checkpoint_keep_last is not None:
        overrides["keep_last"] = args.checkpoint_keep_last
    ckpt = dataclasses.replace(ckpt, **overrides)  # type: ignore[arg-type]
    script_args = list(args.training_script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return AgentConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=_nproc(str(args.nproc_per_node)),
        max_restarts=args.max_restarts,
        monitor_interval_s=parse_duration(args.monitor_interval, name="monitor-interval"),
        master_addr=args.rdzv_endpoint,
        standalone=args.standalone,
        job_id=job_id,
        node_id=args.node_id or env.get("PHALANX_NODE_ID") or socket.gethostname(),
        host=args.local_addr or env.get("PHALANX_HOST") or _default_host(),
        token_file=args.token_file or env.get("PHALANX_TOKEN_FILE", ""),
        log_dir=args.log_dir,
        role=args.role,
        module=args.module,
        no_python=args.no_python,
        script=args.training_script,
        script_args=script_args,
        grace_period_s=parse_duration(args.grace_period, name="grace-period"),
        warm_spares=not args.no_warm_spares and env.get("PHALANX_WARM_SPARES", "1") != "0",
        warm_probes=not args.no_warm_probes and env.get("PHALANX_WARM_PROBES", "1") != "0",
        checkpoint_host=not args.no_checkpoint_host and env.get("PHALANX_CHECKPOINT_HOST", "1") != "0",
        checkpoint=ckpt,
        hang=hang,
        notes=notes,
    )


def print_notes(config: AgentConfig) -> None:
    for note in config.notes:
        print(f"phalanx-run: note: {note}", file=sys.stderr)
