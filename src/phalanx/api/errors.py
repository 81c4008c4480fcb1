"""The phalanx error hierarchy.

Every error phalanx raises on purpose derives from :class:`PhalanxError`; its message is one sentence a
person can act on, and the underlying cause stays chained (``raise ... from exc``)::

    PhalanxError
    ├── ConfigError                  invalid settings, flags, environment or ElasticJob spec
    ├── AuthenticationError          missing or wrong job token
    ├── TransportError               the master cannot be reached or answered with an error
    ├── RendezvousError
    │   ├── RendezvousClosedError    the job is over; no more rounds
    │   └── RendezvousTimeoutError   too few nodes joined in time
    ├── WorkerError
    │   └── LaunchError              worker processes could not be started
    ├── CheckpointError
    │   ├── CheckpointNotFoundError  nothing to load
    │   ├── CheckpointCorruptError   a stored or in-memory snapshot failed its checksum
    │   └── PersistError             writing a snapshot to storage failed (disk full, permissions)
    ├── StateStoreError              the master's durable state could not be read or written
    ├── MasterFenced                 another master took over the job's state: this one stops
    └── KubernetesError              the Kubernetes API refused or failed an operation
"""

from __future__ import annotations


class PhalanxError(Exception):
    """Base of every error phalanx raises on purpose."""


class ConfigError(PhalanxError, ValueError):
    """A setting, flag, environment variable or spec field has an invalid value.

    ``field`` names the setting (as the user wrote it) so the message can say what to fix.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class AuthenticationError(PhalanxError):
    """The job token is missing or wrong."""


class TransportError(PhalanxError):
    """The master could not be reached, or answered a call with an error."""


class RendezvousError(PhalanxError):
    """A rendezvous round could not be completed."""


class RendezvousClosedError(RendezvousError):
    """The job is over; no further rounds will complete."""


class RendezvousTimeoutError(RendezvousError):
    """Too few nodes joined before the rendezvous deadline."""


class WorkerError(PhalanxError):
    """Worker processes failed in a way the agent cannot handle itself."""


class LaunchError(WorkerError):
    """Worker processes could not be started (bad command, missing script)."""


class CheckpointError(PhalanxError):
    """Saving or loading a checkpoint failed."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint exists to load."""


class CheckpointCorruptError(CheckpointError):
    """A snapshot failed its checksum or structure check; it is never loaded."""


class PersistError(CheckpointError):
    """Writing a snapshot to storage failed (disk full, permissions, storage unreachable)."""


class StateStoreError(PhalanxError):
    """The master's durable state could not be read or written."""


class MasterFenced(PhalanxError):
    """Another master took over the job's durable state (a replacement, started when this one's node stopped
    answering): this one must stop at once, writing nothing more."""


class KubernetesError(PhalanxError):
    """The Kubernetes API refused or failed an operation."""
