"""``phalanx operator``: the kopf operator for ElasticJobs (needs the ``phalanx[operator]`` extra)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from phalanx.api.settings import OperatorSettings, describe, from_env, from_mapping


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="Run the Kubernetes operator for ElasticJobs.",
        description="Runs the ElasticJob operator (kopf). Credentials: in-cluster service account, else "
        "$KUBECONFIG. Settings also come from PHALANX_OPERATOR_* environment variables.",
    )
    fields = {f.name: f for f in OperatorSettings.__dataclass_fields__.values()}
    for name in ("namespace", "image", "command_prefix", "master_grpc_port", "master_http_port", "http_port"):
        parser.add_argument(f"--{name.replace('_', '-')}", default=None, help=describe(fields[name]))
    parser.add_argument("--reconcile-interval", default=None, help=describe(fields["reconcile_interval_s"]))
    parser.add_argument("--verbose", action="store_true", help="Log every handler call.")
    parser.set_defaults(handler=run)


def settings_from(args: argparse.Namespace) -> OperatorSettings:
    base = from_env(OperatorSettings, os.environ, prefix="PHALANX_OPERATOR_")
    values: dict[str, Any] = {k: getattr(base, k) for k in OperatorSettings.__dataclass_fields__}
    for name in ("namespace", "image", "command_prefix", "master_grpc_port", "master_http_port", "http_port"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.reconcile_interval is not None:
        values["reconcile_interval_s"] = args.reconcile_interval
    return from_mapping(OperatorSettings, values)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import socket

    import kopf
    from kubernetes import client, config

    from phalanx.operator.executor import Executor, read_metrics_token
    from phalanx.operator.handlers import install
    from phalanx.operator.telemetry import loop_answers, serve

    settings = settings_from(args)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    executor = Executor(api=client.ApiClient(), settings=settings)
    registry = install(executor=executor, settings=settings)
    namespaces = [settings.namespace] if settings.namespace else []
    # kopf would name itself after the login name, which a container run as a uid without a passwd entry
    # (any runAsUser, OpenShift's random ones) does not have: getpwuid() fails and the operator dies.
    identity: Any = f"phalanx-operator@{socket.gethostname()}/{os.getpid()}"  # kopf's Identity is a str

    async def operate() -> None:
        loop = asyncio.get_running_loop()
        server = None
        if settings.http_port:
            server = serve(
                port=settings.http_port,
                metrics=executor.metrics,
                healthy=lambda: loop_answers(loop),
                token=read_metrics_token(settings.metrics_token_file),
            )
        try:
            await kopf.operator(
                registry=registry,
                identity=identity,
                standalone=True,  # one operator per cluster; no kopf peering objects needed
                clusterwide=not namespaces,
                namespaces=namespaces,
            )
        finally:
            if server is not None:
                server.shutdown()

    asyncio.run(operate())
    return 0
