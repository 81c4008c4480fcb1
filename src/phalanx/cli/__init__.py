"""Entry points: ``phalanx`` (subcommands) and ``phalanx-run`` (the node agent, torchrun-compatible)."""
