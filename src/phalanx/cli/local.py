"""``phalanx local``: run a job on this machine as a master plus N node agents, with fault injection."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "local",
        help="Run a training job on this machine: a master and N node agents, with optional faults.",
        description=(
            "Runs a master and N phalanx-run agents (node-0, node-1, ...) on this machine, carries out the "
            "master's evictions by starting replacement nodes, and injects faults for chaos testing. "
            "Example: phalanx local --nodes 2:3 --nproc-per-node 2 --inject kill-worker@step=20,node=1 "
            "-- examples/ddp_mlp.py --steps 100"
        ),
    )
    p.add_argument("--nodes", required=True, help="MIN:MAX nodes of the job (or N).")
    p.add_argument("--initial", type=int, default=None, help="Nodes started at first (default: MAX).")
    p.add_argument("--nproc-per-node", type=int, default=1, help="Training processes per node.")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@key=value,...",
        help="Fault to inject: kill-worker, kill-node, hang-worker, kill-master, delay-node (latency=), "
        "partition-node, slow-network (rate=), slow-cpu (cpu=), kill-checkpoint-host or "
        "hang-checkpoint-host, with step=, after=, node=, rank=, for= "
        "(e.g. kill-worker@step=20,node=1,rank=0, partition-node@after=10s,node=1,for=5s, "
        "slow-network@after=5s,node=2,rate=20mbit, slow-cpu@step=10,node=1,cpu=200m). Repeatable.",
    )
    p.add_argument(
        "--private-network",
        action="store_true",
        help="Run each node in a network namespace of its own, joined by a private switch, as Pods are "
        "(slow-network implies it; needs root).",
    )
    p.add_argument("--summary-json", type=Path, default=None, help="Write the run summary here as JSON.")
    p.add_argument("--max-replacements", type=int, default=3, help="Evicted nodes that get a replacement.")
    p.add_argument(
        "--replace-delay", default="0s", help="Wait this long before starting a replacement node (Pod start)."
    )
    p.add_argument("--max-restarts", type=int, default=3, help="Each agent's --max-restarts.")
    p.add_argument("--heartbeat-timeout", default=None, help="The master's heartbeat timeout (e.g. 2s).")
    p.add_argument(
        "--workdir", type=Path, default=None, help="Where logs and state go (default: a temp dir)."
    )
    p.add_argument("--job-id", default="", help="Job id (default: local-<random>).")
    p.add_argument("--timeout", default="1h", help="Give up after this long.")
    p.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        help="Extra phalanx-run flag, e.g. --agent-arg=--hang-floor=2s.",
    )
    p.add_argument("--master-arg", action="append", default=[], help="Extra phalanx master flag.")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from phalanx.api.errors import ConfigError
    from phalanx.api.settings import parse_duration, parse_node_range
    from phalanx.local import inject
    from phalanx.local.cluster import LocalCluster, LocalOptions

    low, high = parse_node_range(args.nodes, name="nodes")
    initial = high if args.initial is None else args.initial
    if not 1 <= initial <= high:
        raise ConfigError(f"must be between 1 and {high}, got {initial}", field="initial")
    if args.nproc_per_node < 1:
        raise ConfigError(f"must be at least 1, got {args.nproc_per_node}", field="nproc-per-node")
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ConfigError("give the training script after --, e.g. -- examples/ddp_mlp.py", field="command")
    injections = [inject.parse(spec) for spec in args.inject]
    inject.validate(injections, initial_nodes=initial, nproc_per_node=args.nproc_per_node)
    hb = parse_duration(args.heartbeat_timeout, name="heartbeat-timeout") if args.heartbeat_timeout else None

    def go(workdir: Path) -> int:
        options = LocalOptions(
            min_nodes=low,
            max_nodes=high,
            initial=initial,
            nproc_per_node=args.nproc_per_node,
            script=command[0],
            script_args=command[1:],
            workdir=workdir,
            injections=injections,
            summary_json=args.summary_json,
            max_replacements=args.max_replacements,
            max_restarts=args.max_restarts,
            heartbeat_timeout_s=hb,
            agent_args=list(args.agent_arg),
            master_args=list(args.master_arg),
            timeout_s=parse_duration(args.timeout, name="timeout"),
            job_id=args.job_id,
            replace_delay_s=parse_duration(args.replace_delay, name="replace-delay"),
            private_network=args.private_network,
        )
        return LocalCluster(options).run()

    if args.workdir is not None:
        return go(args.workdir)
    with tempfile.TemporaryDirectory(prefix="phalanx-local-") as tmp:
        return go(Path(tmp))
