"""How the job's bearer token travels: the ``authorization`` gRPC metadata key / HTTP header with the value
``Bearer <token>``. Clients and the master's checks build it here, so the format lives in one place."""

from __future__ import annotations

HEADER = "authorization"


def bearer(token: str) -> str:
    """The header value that carries ``token``."""
    return f"Bearer {token}"


def metadata(token: str) -> tuple[tuple[str, str]]:
    """gRPC call metadata carrying ``token``."""
    return ((HEADER, bearer(token)),)
