"""How ``phalanx status`` and ``phalanx timeline`` reach a job's master HTTP API.

Either directly (``--master URL``, the job token from ``--token-file`` or ``PHALANX_TOKEN_FILE``), or
through the kube context (``--job NAME [-n NS]``): the token comes from the job's Secret
(``<job>-token``, key ``token``) and the address from its master Service (``<job>-master``, port ``http``),
``http://<job>-master.<ns>.svc:<port>``, which resolves inside the cluster. From outside it,
``kubectl port-forward -n NS svc/<job>-master 8080`` and ``--master http://127.0.0.1:8080`` together with
``--job NAME`` (for the token) reach the same master.

The token is sent only as the ``Authorization`` header and never printed.
"""

from __future__ import annotations

import argparse
import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.api import auth
from phalanx.api.errors import ConfigError, KubernetesError, TransportError

__all__ = ["Kube", "MasterAPI", "add_kube_flags", "add_master_flags", "master_from_args"]

TOKEN_FILE_ENV = "PHALANX_TOKEN_FILE"  # noqa: S105 -- a variable name, not a secret
SECRET_KEY = "token"  # noqa: S105 -- the key of the job token Secret, not a secret
GROUP, VERSION, PLURAL = "phalanx.dev", "v1alpha1", "elasticjobs"


def add_master_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--master", default="", metavar="URL", help="The master's HTTP API, e.g. http://host:8080."
    )
    p.add_argument(
        "--token-file",
        default=None,
        help=f"File holding the job token (default: ${TOKEN_FILE_ENV}; with --job: the job's Secret).",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="Seconds to wait for each answer.")


def add_kube_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n", "--namespace", default="", help="The ElasticJob's namespace (default: the context's)."
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)."
    )
    p.add_argument("--context", default=None, help="kubeconfig context (default: the current one).")


@dataclass
class MasterAPI:
    """GETs JSON from one master's HTTP API."""

    url: str
    token: str
    timeout_s: float = 10.0

    def get(self, path: str, **params: Any) -> Any:
        import httpx

        query = {k: v for k, v in params.items() if v is not None and v != ""}
        headers = {auth.HEADER: auth.bearer(self.token)}
        try:
            resp = httpx.get(
                self.url.rstrip("/") + path, params=query, headers=headers, timeout=self.timeout_s
            )
        except httpx.HTTPError as exc:
            hint = ""
            if ".svc:" in self.url:  # a Service's cluster DNS name: resolves only inside the cluster
                hint = (
                    "; from outside the cluster, run `kubectl port-forward -n NS svc/JOB-master 8080` "
                    "and add --master http://127.0.0.1:8080"
                )
            raise TransportError(f"cannot reach the master at {self.url}: {exc}{hint}") from None
        if resp.status_code == 401:
            raise ConfigError(f"the master at {self.url} refused the job token (401)", field="token-file")
        if resp.status_code != 200:
            try:
                why = str(resp.json().get("error") or resp.json())
            except ValueError:
                why = resp.text[:200]
            raise TransportError(f"GET {path} answered {resp.status_code}: {why}")
        return resp.json()


class Kube:
    """The few reads the CLI makes through the kube context (the ``kubernetes`` client, phalanx[operator])."""

    def __init__(self, *, kubeconfig: str | None, context: str | None, namespace: str) -> None:
        try:
            from kubernetes import client, config
        except ImportError:
            raise ConfigError(
                "reading a job through the kube context needs the kubernetes client: "
                "pip install 'phalanx[operator]'"
            ) from None
        try:
            if kubeconfig or os.environ.get("KUBECONFIG") or Path("~/.kube/config").expanduser().exists():
                api = config.new_client_from_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
                contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
                chosen = active
                if context:
                    chosen = next((c for c in contexts if c.get("name") == context), active)
                default_ns = (chosen or {}).get("context", {}).get("namespace") or "default"
            else:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
                api = client.ApiClient()
                ns_file = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
                default_ns = ns_file.read_text().strip() if ns_file.exists() else "default"
        except (config.ConfigException, OSError) as exc:
            raise ConfigError(f"no usable kube context: {exc}", field="kubeconfig") from None
        self.namespace = namespace or default_ns
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            raise KubernetesError(
                f"reading {what} in namespace {self.namespace}: {exc.status} {exc.reason}"
            ) from None
        except Exception as exc:  # connection refused, TLS: the API server cannot be reached
            raise KubernetesError(f"reading {what}: {exc}") from None

    def elastic_job(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self._call(
            f"ElasticJob {name}",
            self.custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            name,
        )
        return obj

    def pods(self, job: str) -> list[Any]:
        result = self._call(
            f"the Pods of {job}",
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=f"phalanx.dev/job={job}",
        )
        return list(result.items)

    def token(self, job: str) -> str:
        secret = self._call(
            f"Secret {job}-token", self.core.read_namespaced_secret, f"{job}-token", self.namespace
        )
        raw = (secret.data or {}).get(SECRET_KEY)
        if not raw:
            raise KubernetesError(f"Secret {job}-token has no {SECRET_KEY!r} key")
        return base64.b64decode(raw).decode().strip()

    def master_url(self, job: str) -> str:
        svc = self._call(
            f"Service {job}-master", self.core.read_namespaced_service, f"{job}-master", self.namespace
        )
        port = next((p.port for p in svc.spec.ports or [] if p.name == "http"), None)
        if port is None:
            raise KubernetesError(f"Service {job}-master has no port named http")
        return f"http://{job}-master.{self.namespace}.svc:{port}"


def _token_file(path: str | None) -> str:
    path = path or os.environ.get(TOKEN_FILE_ENV, "")
    if not path:
        raise ConfigError(
            f"give the job token with --token-file or ${TOKEN_FILE_ENV} (or --job NAME to read it from the "
            "job's Secret)",
            field="token-file",
        )
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", field="token-file") from None
    return auth.check_token(token, field="token-file", source=path)


def master_from_args(args: argparse.Namespace, *, job: str = "") -> MasterAPI:
    """The master that ``--master``/``--token-file`` name, or that of job ``job`` through the kube context
    (``--master`` then only overrides the address, e.g. a port-forward)."""
    if not job:
        if not args.master:
            raise ConfigError("give --master URL (with the job token) or --job NAME", field="master")
        return MasterAPI(args.master, _token_file(args.token_file), args.timeout)
    kube = Kube(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace)
    token = _token_file(args.token_file) if args.token_file else kube.token(job)
    url = args.master or kube.master_url(job)
    return MasterAPI(url, token, args.timeout)
