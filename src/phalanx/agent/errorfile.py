"""Reading the error file a worker writes through torch elastic's ``@record`` (TORCHELASTIC_ERROR_FILE)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ErrorReport:
    message: str
    traceback: str
    unix_ns: int


def parse(text: str) -> ErrorReport | None:
    """Parses torch elastic's format; returns None for anything else (it is the worker's file, not ours)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    outer = data.get("message")
    if isinstance(outer, str):  # the form torch writes for errors it could not structure
        return ErrorReport(message=outer, traceback="", unix_ns=0)
    if not isinstance(outer, dict):
        return None
    message = str(outer.get("message", ""))
    extra = outer.get("extraInfo") if isinstance(outer.get("extraInfo"), dict) else {}
    traceback = str(extra.get("py_callstack", "")) if extra else ""
    try:
        unix_ns = int(float(extra.get("timestamp", 0)) * 1e9) if extra else 0
    except (TypeError, ValueError):
        unix_ns = 0
    return ErrorReport(message=message, traceback=traceback, unix_ns=unix_ns)


def read(path: Path) -> ErrorReport | None:
    try:
        return parse(path.read_text(errors="replace"))
    except OSError:
        return None
