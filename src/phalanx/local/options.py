"""What ``phalanx local`` is asked to run: the command line's options, parsed (:mod:`phalanx.cli.local`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from phalanx.local.inject import Injection


@dataclass(frozen=True, kw_only=True)
class LocalOptions:
    min_nodes: int
    max_nodes: int
    initial: int
    nproc_per_node: int
    script: str
    script_args: list[str]
    workdir: Path
    injections: list[Injection] = field(default_factory=list)
    summary_json: Path | None = None
    max_replacements: int = 3
    max_restarts: int = 3
    heartbeat_timeout_s: float | None = None
    agent_args: list[str] = field(default_factory=list)
    master_args: list[str] = field(default_factory=list)
    timeout_s: float = 3600.0
    replace_delay_s: float = 0.0
    """Time between an eviction and the start of its replacement (a Kubernetes Pod takes a while too)."""
    show_output: bool = False
    job_id: str = ""
    private_network: bool = False
    """Each node in a network namespace of its own (:mod:`phalanx.local.fabric`); slow-network implies it."""
