"""The master Pod's liveness check: ``python -m phalanx.master.livez``, an exec probe the kubelet runs.

Every master endpoint wants the job token, ``/healthz`` included, and a Pod spec cannot carry a secret header
(anyone who may read the Pod would read the token). So the kubelet runs this inside the master's container
instead: it reads the mounted token and asks the master's own ``/healthz``, over TLS verified against the
job's CA by the name every master certificate carries when the master serves TLS. Exit 0: the master's
event loop answered 200 within the timeout; 1 otherwise, with the reason on stderr (the kubelet shows it in
the Pod's events). A master that stopped answering is killed; its Pod (``restartPolicy: Never``) fails and
the operator starts a new master, which resumes from the job's state.

Standard library only: it runs every period and must cost milliseconds, not a second of imports.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
import sys
from pathlib import Path

HOST_ENV = "POD_IP"
"""The address the master listens on, as the operator's Pod gives it (``--host $(POD_IP)``)."""


def check(*, host: str, port: int, token: str, ca_file: str, server_name: str, timeout_s: float) -> str:
    """ "" when the master answered ``GET /healthz`` with 200, else what went wrong."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            conn: socket.socket = raw
            if ca_file:
                context = ssl.create_default_context(cafile=ca_file)
                conn = context.wrap_socket(raw, server_hostname=server_name)
            request = (
                f"GET /healthz HTTP/1.1\r\nHost: {server_name}\r\nAuthorization: Bearer {token}\r\n"
                "Connection: close\r\n\r\n"
            )
            conn.sendall(request.encode())
            status = conn.makefile("rb").readline(256).decode("latin-1").split()
    except (OSError, ssl.SSLError) as exc:
        return f"the master at {host}:{port} did not answer: {exc}"
    if len(status) < 2 or status[1] != "200":
        return f"the master at {host}:{port} answered /healthz with {' '.join(status[:3]) or 'nothing'}"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.master.livez", description="Master liveness.")
    parser.add_argument("--port", type=int, required=True, help="the master's HTTP port")
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--host", default="", help=f"default: ${HOST_ENV}, else 127.0.0.1")
    parser.add_argument("--ca-file", default="", help="the job's CA certificate; the master serves TLS")
    parser.add_argument("--server-name", default="phalanx-master", help="the name to verify (with --ca-file)")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    try:
        token = Path(args.token_file).read_text().strip()
    except OSError as exc:
        print(f"cannot read the job token: {exc.strerror}", file=sys.stderr)
        return 1
    problem = check(
        host=args.host or os.environ.get(HOST_ENV) or "127.0.0.1",
        port=args.port,
        token=token,
        ca_file=args.ca_file,
        server_name=args.server_name,
        timeout_s=args.timeout_s,
    )
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
