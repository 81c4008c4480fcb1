"""The class of a worker's failure: one enum for the agent, the master and the diagnostics."""

from __future__ import annotations

import enum

__all__ = ["FailureClass"]


class FailureClass(enum.IntEnum):
    """Mirrors ``phalanx.v1.FailureClass`` value for value, so it converts with ``int()``. Its
    :attr:`label` (the lower-case name) is what the JSON, the HTTP API, events and metrics print."""

    UNSPECIFIED = 0
    USER = 1
    KILLED = 2
    OOM = 3
    COMM = 4
    HARDWARE = 5
    HANG = 6
    UNKNOWN = 7

    @property
    def label(self) -> str:
        """user, killed, oom, comm, hardware, hang, unknown (or unspecified)."""
        return self.name.lower()

    @classmethod
    def of(cls, value: int) -> FailureClass:
        """The class of a wire value; UNKNOWN for a value this version does not know."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN

    @classmethod
    def from_label(cls, label: str) -> FailureClass:
        """The class a :attr:`label` names."""
        return cls[label.upper()]
