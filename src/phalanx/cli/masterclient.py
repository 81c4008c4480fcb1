"""How ``phalanx status`` and ``phalanx timeline`` reach a job's master HTTP API.

Either directly (``--master URL``, the job token from ``--token-file`` or ``PHALANX_TOKEN_FILE``), or
through the kube context (``--job NAME [-n NS]``): the token comes from the job's Secret
(``<job>-token``, key ``token``) and the address from its master Service (``<job>-master``, port ``http``),
``http://<job>-master.<ns>.svc:<port>``, which resolves inside the cluster. From outside it,
``kubectl port-forward -n NS svc/<job>-master 8080`` and ``--master http://127.0.0.1:8080`` together with
``--job NAME`` (for the token) reach the same master.

A master started with TLS (the operator's ``tls_ca_secret``, or ``phalanx master --tls-cert-file``) serves
HTTPS only. The CLI verifies its certificate against the job's CA: ``--ca-file`` (default
``$PHALANX_TLS_CA_FILE``) or, with ``--job``, the ``ca.crt`` of the job's Secret ``<job>-tls`` when the
operator made one. The name checked is the URL's host, ``<job>-master`` with ``--job`` (a port-forward to
127.0.0.1 still verifies the Service's name), or ``--server-name``. The token is sent only after the
certificate verified.

The token is sent only as the ``Authorization`` header and never printed.
"""

from __future__ import annotations

import argparse
import base64
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from phalanx.api import auth, elasticjob
from phalanx.api.errors import ConfigError, KubernetesError, TransportError

__all__ = ["Kube", "MasterAPI", "add_kube_flags", "add_master_flags", "master_from_args"]

TOKEN_FILE_ENV = "PHALANX_TOKEN_FILE"  # noqa: S105 -- a variable name, not a secret
TLS_SECRET_SUFFIX, CA_KEY = "-tls", "ca.crt"  # the job's TLS Secret, as phalanx.operator.tls writes it
SECRET_KEY = elasticjob.TOKEN_KEY
GROUP, VERSION, PLURAL = elasticjob.GROUP, elasticjob.VERSION, elasticjob.PLURAL


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
    p.add_argument(
        "--ca-file",
        default=None,
        help=f"The job's CA certificate (PEM), for a master that serves TLS (default: ${auth.TLS_CA_ENV}; "
        "with --job: the ca.crt of the job's Secret JOB-tls). A URL without a scheme is then https.",
    )
    p.add_argument(
        "--server-name",
        default="",
        help="The name the master's certificate must carry (default: the URL's host; with --job: "
        "JOB-master). Every master certificate the operator issues also carries phalanx-master.",
    )


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
    """GETs JSON from one master's HTTP API; over HTTPS verified against ``ca_pem`` (the job's CA) when the
    URL is ``https://``."""

    url: str
    token: str
    timeout_s: float = 10.0
    ca_pem: str = ""
    """The CA certificate(s) that must have signed the master's certificate (PEM); empty: the system's."""
    ca_source: str = ""
    """Where ``ca_pem`` came from, for messages (a file name, a Secret)."""
    server_name: str = ""
    """The name the certificate must carry instead of the URL's host (e.g. a port-forward to 127.0.0.1)."""

    def _verify(self) -> ssl.SSLContext | bool:
        if not self.url.startswith("https://"):
            return True  # unused for http://
        try:
            return ssl.create_default_context(cadata=self.ca_pem or None)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{self.ca_source or 'the CA'} holds no usable PEM certificate: {exc}", field="ca-file"
            ) from None

    def get(self, path: str, **params: Any) -> Any:
        import httpx

        query = {k: v for k, v in params.items() if v is not None and v != ""}
        headers = {auth.HEADER: auth.bearer(self.token)}
        extensions = {"sni_hostname": self.server_name} if self.server_name else {}
        try:
            with httpx.Client(verify=self._verify(), timeout=self.timeout_s) as client:
                resp = client.get(
                    self.url.rstrip("/") + path, params=query, headers=headers, extensions=extensions
                )
        except httpx.HTTPError as exc:
            raise TransportError(f"cannot reach the master at {self.url}: {exc}{self._hint(exc)}") from None
        if resp.status_code == 401:
            raise ConfigError(f"the master at {self.url} refused the job token (401)", field="token-file")
        if resp.status_code != 200:
            try:
                why = str(resp.json().get("error") or resp.json())
            except ValueError:
                why = resp.text[:200]
            raise TransportError(f"GET {path} answered {resp.status_code}: {why}")
        return resp.json()

    def _hint(self, exc: Exception) -> str:
        """What to do about a failed request, for the cases a person can fix with a flag."""
        text = str(exc)
        if "CERTIFICATE_VERIFY_FAILED" in text:
            if "hostname" in text or "IP address mismatch" in text:
                name = self.server_name or urlsplit(self.url).hostname
                return (
                    f"; its certificate does not name {name}: give the name it carries with --server-name "
                    "(JOB-master or phalanx-master for a master the operator runs)"
                )
            trusted = self.ca_source or "the system's CAs"
            return (
                f"; its certificate was not signed by {trusted}: give the job's CA with --ca-file or "
                f"${auth.TLS_CA_ENV} (the operator keeps it in the Secret JOB-tls, key {CA_KEY})"
            )
        if self.url.startswith("http://") and isinstance(exc, httpx_protocol_errors()):
            return (
                "; a master with TLS on answers HTTPS only: use an https:// URL with the job's CA "
                f"(--ca-file or ${auth.TLS_CA_ENV})"
            )
        if ".svc:" in self.url:  # a Service's cluster DNS name: resolves only inside the cluster
            scheme = urlsplit(self.url).scheme
            return (
                "; from outside the cluster, run `kubectl port-forward -n NS svc/JOB-master 8080` "
                f"and add --master {scheme}://127.0.0.1:8080"
            )
        return ""


def httpx_protocol_errors() -> tuple[type[Exception], ...]:
    """What httpx raises when a plain-text request reaches a TLS server (it answers with a TLS alert, or
    closes the connection)."""
    import httpx

    return (httpx.RemoteProtocolError, httpx.ReadError)


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
            f"Secret {elasticjob.token_secret(job)}",
            self.core.read_namespaced_secret,
            elasticjob.token_secret(job),
            self.namespace,
        )
        raw = (secret.data or {}).get(SECRET_KEY)
        if not raw:
            raise KubernetesError(f"Secret {elasticjob.token_secret(job)} has no {SECRET_KEY!r} key")
        return base64.b64decode(raw).decode().strip()

    def ca_pem(self, job: str) -> str:
        """The CA certificate of the job's TLS Secret (``<job>-tls``, key ``ca.crt``); empty when the job has
        none (TLS off)."""
        from kubernetes.client.exceptions import ApiException

        name = job + TLS_SECRET_SUFFIX
        try:
            secret = self.core.read_namespaced_secret(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return ""
            raise KubernetesError(
                f"reading Secret {name} in namespace {self.namespace}: {exc.status} {exc.reason}"
            ) from None
        except Exception as exc:
            raise KubernetesError(f"reading Secret {name}: {exc}") from None
        raw = (secret.data or {}).get(CA_KEY)
        return base64.b64decode(raw).decode() if raw else ""

    def master_url(self, job: str, *, tls: bool = False) -> str:
        svc = self._call(
            f"Service {elasticjob.master(job)}",
            self.core.read_namespaced_service,
            elasticjob.master(job),
            self.namespace,
        )
        port = next((p.port for p in svc.spec.ports or [] if p.name == "http"), None)
        if port is None:
            raise KubernetesError(f"Service {job}-master has no port named http")
        scheme = "https" if tls else "http"
        return f"{scheme}://{elasticjob.master(job)}.{self.namespace}.svc:{port}"


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


def _ca_file(path: str | None) -> tuple[str, str]:
    """The PEM and the name of ``--ca-file`` (default ``$PHALANX_TLS_CA_FILE``); empty when neither is set."""
    path = os.environ.get(auth.TLS_CA_ENV, "") if path is None else path
    if not path:
        return "", ""
    try:
        return Path(path).read_text(), path
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a PEM file"
        raise ConfigError(f"cannot read {path}: {why}", field="ca-file") from None


def _with_scheme(url: str, *, tls: bool) -> str:
    """``url``, with ``https://`` (a CA was given) or ``http://`` in front when it has no scheme."""
    if "://" in url:
        return url
    return ("https://" if tls else "http://") + url


def master_from_args(args: argparse.Namespace, *, job: str = "") -> MasterAPI:
    """The master that ``--master``/``--token-file`` name, or that of job ``job`` through the kube context
    (``--master`` then only overrides the address, e.g. a port-forward)."""
    ca_pem, ca_source = _ca_file(getattr(args, "ca_file", None))
    server_name = getattr(args, "server_name", "")
    if not job:
        if not args.master:
            raise ConfigError("give --master URL (with the job token) or --job NAME", field="master")
        url = _with_scheme(args.master, tls=bool(ca_pem))
        return MasterAPI(url, _token_file(args.token_file), args.timeout, ca_pem, ca_source, server_name)
    kube = Kube(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace)
    token = _token_file(args.token_file) if args.token_file else kube.token(job)
    if not ca_pem:
        ca_pem = kube.ca_pem(job)
        ca_source = f"the CA of Secret {job}{TLS_SECRET_SUFFIX}" if ca_pem else ""
    tls = bool(ca_pem)
    url = _with_scheme(args.master, tls=tls) if args.master else kube.master_url(job, tls=tls)
    # The certificate names the job's Service, not a port-forward's 127.0.0.1.
    return MasterAPI(url, token, args.timeout, ca_pem, ca_source, server_name or elasticjob.master(job))
