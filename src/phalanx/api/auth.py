"""How the job's bearer token travels: the ``authorization`` gRPC metadata key / HTTP header with the value
``Bearer <token>``. Clients and the master's checks build it here, so the format lives in one place, and
so does what a token must be (:func:`check_token`), and how a client reaches a master that serves TLS
(:func:`master_channel`)."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx.api.errors import ConfigError

HEADER = "authorization"

MIN_TOKEN_CHARS = 16
"""A token shorter than this can be guessed; the tokens phalanx makes itself have 48 or more characters."""


def bearer(token: str) -> str:
    """The header value that carries ``token``."""
    return f"Bearer {token}"


def metadata(token: str) -> tuple[tuple[str, str]]:
    """gRPC call metadata carrying ``token``."""
    return ((HEADER, bearer(token)),)


def check_token(token: str, *, field: str, source: str = "the token") -> str:
    """Returns ``token`` when it is one word of at least :data:`MIN_TOKEN_CHARS` characters; otherwise a
    :class:`ConfigError` naming ``field`` and ``source`` (a file name), never the token itself."""
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(
            f"{source} must hold one token of at least {MIN_TOKEN_CHARS} characters without spaces "
            f"(it holds {len(token)} characters)",
            field=field,
        )
    return token


STORE_KEY_ENV = "PHALANX_STORE_KEY"
"""A store's key for the process that meets its peers there (:func:`store_key`), never on a command line."""


def store_key(token: str, purpose: str) -> str:
    """The secret prefix of one TCPStore's keys: HMAC-SHA256 of ``purpose`` under the job token (32 hex).

    A TCPStore authenticates nobody: whoever reaches its port may read and write any key it can name. Keys
    under a prefix only the job's members can compute cannot be named by anyone else, so a stranger cannot
    forge the keys a group forms by (the probe's ``missing`` list, gloo's peer addresses). Each purpose (a
    probe round, a rendezvous round) gets its own, so a prefix seen on the wire once opens nothing later."""
    return hmac.new(token.encode(), purpose.encode(), hashlib.sha256).hexdigest()[:32]


TLS_CA_ENV = "PHALANX_TLS_CA_FILE"
"""The CA that signed the master's certificate, for a master started with TLS: every process that calls the
master (the agent, the checkpoint host's reports) inherits it."""


def master_channel(
    address: str, *, ca_file: str | None = None, options: Sequence[tuple[str, Any]] = ()
) -> Any:
    """A gRPC channel to the master: TLS verified against ``ca_file`` (default: :data:`TLS_CA_ENV`'s file)
    when there is one, plain otherwise."""
    import grpc

    ca_file = os.environ.get(TLS_CA_ENV, "") if ca_file is None else ca_file
    if not ca_file:
        return grpc.insecure_channel(address, options=list(options))
    try:
        roots = Path(ca_file).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {ca_file}: {exc.strerror}", field=TLS_CA_ENV) from exc
    credentials = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.secure_channel(address, credentials, options=list(options))
