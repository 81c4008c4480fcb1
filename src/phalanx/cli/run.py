"""``phalanx-run``: the node agent, a drop-in replacement for torchrun."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from phalanx.agent.cli import run_agent

    return int(run_agent(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
