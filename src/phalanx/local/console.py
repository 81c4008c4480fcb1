"""The console of ``phalanx local``: every line stamped with the seconds since the run started, and the
live status line shown when it changes (:func:`~phalanx.local.decide.status_due`)."""

from __future__ import annotations

import time
from typing import TextIO

from phalanx.local.decide import status_due


class Console:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.t0 = 0.0
        self.last_status = ""
        self.last_status_at = 0.0

    def start(self) -> None:
        """The run starts now: times are counted from here."""
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():7.2f}s] {text}", file=self.out, flush=True)

    def status(self, line: str) -> None:
        """Shows the status line when it changed, at most once a second."""
        if status_due(line, last=self.last_status, last_at=self.last_status_at, now=self.elapsed()):
            self.last_status, self.last_status_at = line, self.elapsed()
            self.say(line)

    def show(self, text: str) -> None:
        """Prints ``text`` as it is (the summary table)."""
        print(text, file=self.out, flush=True)
