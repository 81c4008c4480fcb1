"""``phalanx master``: runs one job's master (gRPC for agents, HTTP for people and Prometheus).

Every field of :class:`~phalanx.api.settings.MasterSettings` is a flag (``--heartbeat-timeout-s``,
``--restart-max-restarts``, ...) and an environment variable (``PHALANX_HEARTBEAT_TIMEOUT_S``, ...);
flags win over the environment. The common ones have short aliases: ``--nodes MIN:MAX``, ``--unit``,
``--port``, ``--state``, ``--heartbeat-interval``, ``--heartbeat-timeout``, ``--last-call``,
``--max-restarts``, ``--max-evictions``.

``--state`` takes a file path, or ``k8s://NAMESPACE/ELASTICJOB`` to keep the state in the cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.api import auth
from phalanx.api.errors import ConfigError
from phalanx.api.settings import ENV_PREFIX, MasterSettings, describe, from_mapping, parse_node_range

__all__ = ["build_settings", "register"]

# Extra, shorter flag names for the settings people set most.
_ALIASES: dict[str, tuple[str, ...]] = {
    "grpc_port": ("--port",),
    "state_path": ("--state",),
    "rendezvous.unit": ("--unit",),
    "rendezvous.last_call_s": ("--last-call",),
    "rendezvous.min_nodes_timeout_s": ("--min-nodes-timeout",),
    "heartbeat.interval_s": ("--heartbeat-interval",),
    "heartbeat.timeout_s": ("--heartbeat-timeout",),
    "restart.max_restarts": ("--max-restarts",),
    "restart.max_evictions": ("--max-evictions",),
}


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any]]]:
    """(dotted path, field) of every leaf setting."""
    out: list[tuple[str, dataclasses.Field[Any]]] = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            out.extend(_leaves(f.default_factory, f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", f))
    return out


def _dest(path: str) -> str:
    return "setting__" + path.replace(".", "__")


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    *groups, leaf = path.split(".")
    for g in groups:
        tree = tree.setdefault(g, {})
    tree[leaf] = value


def build_settings(args: argparse.Namespace, env: Mapping[str, str]) -> MasterSettings:
    """Environment first, then flags on top, then the settings' own validation."""
    values: dict[str, Any] = {}
    for path, _ in _leaves(MasterSettings):
        name = ENV_PREFIX + path.replace(".", "_").upper()
        if name in env:
            _put(values, path, env[name])
    for path, _ in _leaves(MasterSettings):
        given = getattr(args, _dest(path), None)
        if given is not None:
            _put(values, path, given)
    if args.nodes is not None:
        low, high = parse_node_range(args.nodes, name="nodes")
        _put(values, "rendezvous.min_nodes", low)
        _put(values, "rendezvous.max_nodes", high)
    return from_mapping(MasterSettings, values)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "master",
        help="run a job's master (rendezvous, failure policy, logs, status)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nodes", metavar="MIN:MAX", help="nodes per round: N or MIN:MAX (torchrun's --nnodes)"
    )
    for path, f in _leaves(MasterSettings):
        flag = "--" + path.replace(".", "-").replace("_", "-")
        names = (flag, *_ALIASES.get(path, ()))
        parser.add_argument(
            *names, dest=_dest(path), default=None, metavar=path.rsplit(".", 1)[-1].upper(), help=describe(f)
        )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="shut down when the process that started this master exits, even by SIGKILL "
        "(phalanx-run --standalone and phalanx local start their masters so)",
    )
    parser.set_defaults(handler=_handle)


class _Context(logging.Filter):
    """Fills job/node/round on every record so each master log line carries them."""

    def __init__(self, job_id: str) -> None:
        super().__init__()
        self._job = job_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.job = self._job
        if not hasattr(record, "node"):
            record.node = "-"
        if not hasattr(record, "round"):
            record.round = "-"
        return True


def _setup_logging(job_id: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Context(job_id))
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s job=%(job)s round=%(round)s node=%(node)s %(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("PHALANX_LOG_LEVEL", "INFO").upper())


def _read_token(path: str, *, field: str = "token_file") -> str:
    if not path:
        raise ConfigError("the master needs the job's bearer token; pass --token-file", field=field)
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", field=field) from exc
    return auth.check_token(token, field=field, source=path)


def _read_metrics_token(path: str) -> str:
    """The /metrics-only token, or "" without one. A missing file is not fatal: a job created before the
    operator had a metrics token has none in its Secret, and its /metrics keeps needing the job token."""
    if not path:
        return ""
    if not Path(path).exists():
        logging.getLogger("phalanx.master").warning(
            "no metrics token at %s: /metrics needs the job's token", path
        )
        return ""
    return _read_token(path, field="metrics_token_file")


def _stores(state: str, *, progress_interval_s: float = 10.0) -> tuple[Any, Any]:
    from phalanx.master.store.stores import FileStateStore, MemoryStateStore, NullStatusSink

    if state.startswith("k8s://"):
        from phalanx.master.store import kube

        namespace, _, name = state.removeprefix("k8s://").partition("/")
        if not namespace or not name or "/" in name:
            raise ConfigError(f"expected k8s://NAMESPACE/ELASTICJOB, got {state!r}", field="state")
        return kube.state_store(namespace=namespace, name=name), kube.status_sink(
            namespace=namespace, name=name, progress_interval_s=progress_interval_s
        )
    if not state:
        logging.getLogger("phalanx.master").warning("no --state: a restarted master will not resume this job")
        return MemoryStateStore(), NullStatusSink()
    return FileStateStore(state), NullStatusSink()


def _handle(args: argparse.Namespace) -> int:
    import asyncio

    from phalanx.master.serve.server import run_master

    settings = build_settings(args, os.environ)
    token = _read_token(settings.token_file)
    _setup_logging(settings.job_id)
    metrics_token = _read_metrics_token(settings.metrics_token_file)
    if metrics_token == token:
        raise ConfigError("the metrics token must differ from the job's token", field="metrics_token_file")
    store, sink = _stores(settings.state_path, progress_interval_s=settings.status_progress_interval_s)
    parent = os.getppid() if args.exit_with_parent else 0
    return asyncio.run(
        run_master(
            settings, token=token, metrics_token=metrics_token, store=store, sink=sink, parent_pid=parent
        )
    )
