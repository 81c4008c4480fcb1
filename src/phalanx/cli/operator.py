"""``phalanx operator``: the operator for ElasticJobs (needs the ``phalanx[operator]`` extra)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from phalanx.api.settings import OperatorSettings, describe, from_env, from_mapping

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_LEASE_NAMESPACE = "phalanx-system"
FLAGS = (
    "namespace", "image", "command_prefix", "master_grpc_port", "master_http_port", "http_port",
    "cordon_nodes", "network_policy", "monitoring_namespace", "tls_ca_secret",
)  # fmt: skip
"""OperatorSettings fields that are also flags (--cordon-nodes true), named after the field."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="Run the Kubernetes operator for ElasticJobs.",
        description="Runs the ElasticJob operator. Credentials: in-cluster service account, else "
        "$KUBECONFIG. Settings also come from PHALANX_OPERATOR_* environment variables. Several replicas "
        "elect one leader on a Lease ($PHALANX_OPERATOR_LEASE_NAMESPACE, default the service account's "
        "namespace; $PHALANX_OPERATOR_LEADER_ELECTION=false turns the election off for a single replica).",
    )
    fields = {f.name: f for f in OperatorSettings.__dataclass_fields__.values()}
    for name in FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", default=None, help=describe(fields[name]))
    parser.add_argument("--reconcile-interval", default=None, help=describe(fields["reconcile_interval_s"]))
    parser.add_argument("--verbose", action="store_true", help="Log every handler call.")
    parser.set_defaults(handler=run)


def settings_from(args: argparse.Namespace) -> OperatorSettings:
    base = from_env(OperatorSettings, os.environ, prefix="PHALANX_OPERATOR_")
    values: dict[str, Any] = {k: getattr(base, k) for k in OperatorSettings.__dataclass_fields__}
    for name in FLAGS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.reconcile_interval is not None:
        values["reconcile_interval_s"] = args.reconcile_interval
    return from_mapping(OperatorSettings, values)


def lease_namespace(env: dict[str, str] | os._Environ[str]) -> str:
    """Where the leader-election Lease lives: $PHALANX_OPERATOR_LEASE_NAMESPACE (the chart sets the release
    namespace), else the namespace of the Pod's service account, else phalanx-system."""
    if env.get("PHALANX_OPERATOR_LEASE_NAMESPACE"):
        return env["PHALANX_OPERATOR_LEASE_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or DEFAULT_LEASE_NAMESPACE
    except OSError:
        return DEFAULT_LEASE_NAMESPACE


def run(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import logging
    import signal
    import socket

    from kubernetes import client, config

    from phalanx.operator.discovery import unguarded_pods
    from phalanx.operator.executor import Executor
    from phalanx.operator.handlers import Reconciler
    from phalanx.operator.leader import LeaderElector
    from phalanx.operator.telemetry import loop_answers, serve

    settings = settings_from(args)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    if not args.verbose:  # kopf says at INFO what every handler call did
        logging.getLogger("kopf").setLevel(logging.WARNING)
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    configuration = client.Configuration.get_default_copy()
    # The elector, up to 8 passes at once and the ghost sweeps' LISTs: more than urllib3's default 10
    # connections (kopf's watches have their own, aiohttp's).
    configuration.connection_pool_maxsize = 32
    api = client.ApiClient(configuration)
    executor = Executor(api=api, settings=settings, own_namespace=lease_namespace(os.environ))
    # The Pod's name (the hostname) and the process: unique per replica and per restart of one.
    identity = f"{socket.gethostname()}_{os.getpid()}"
    elector: LeaderElector | None = None
    if os.environ.get("PHALANX_OPERATOR_LEADER_ELECTION", "true").lower() not in ("false", "0", "no"):

        def lost() -> None:
            # Leadership lost (the Lease was taken, or not renewed in time): act no more, at once. The
            # executor already refuses every action; exiting ends the passes under way too, and the
            # Deployment restarts the replica as a standby.
            logging.getLogger("phalanx.operator").error("leadership lost: exiting")
            os._exit(1)

        elector = LeaderElector(
            api=api,
            namespace=lease_namespace(os.environ),
            name=os.environ.get("PHALANX_OPERATOR_LEASE_NAME", "phalanx-operator"),
            identity=identity,
            on_lost=lost,
        )
        executor.may_act = elector.leading
    reconciler = Reconciler(executor=executor, settings=settings)

    async def operate() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        started = False
        server = None
        if settings.http_port:
            server = serve(
                port=settings.http_port,
                metrics=executor.metrics,
                # A standby is healthy while it waits; a leader while its periodic passes run.
                healthy=lambda: loop_answers(loop) and (not started or reconciler.healthy()),
                token=executor.metrics_token,
            )
        try:
            if elector is not None:
                elector.start()
                while not elector.wait_until_leading(0) and not stop.is_set():
                    with contextlib.suppress(TimeoutError):  # a standby: wait for the Lease (or SIGTERM)
                        await asyncio.wait_for(stop.wait(), 0.2)
                if stop.is_set():
                    return
            if unguarded := await loop.run_in_executor(
                None, unguarded_pods, executor.discovery, settings.pod_admission_policy
            ):
                logging.getLogger("phalanx.operator").warning(unguarded)
            started = True
            await reconciler.run(stop)
        finally:
            if elector is not None:
                # Hand the Lease over now rather than make a standby wait out its duration (a rolling
                # update, a drained node).
                await loop.run_in_executor(None, elector.release)
            if server is not None:
                server.shutdown()

    asyncio.run(operate())
    return 0
