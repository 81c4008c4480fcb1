"""The job: the master's state machine, driven by agent requests and a clock tick. Its components decide
from the state (pure functions that return :mod:`~phalanx.master.job.effects`) and one writer
(:class:`~phalanx.master.job.core.JobCore`) changes the state. No I/O: the serving side
(:mod:`phalanx.master.serve`) calls it and carries out what it needs in the outside world."""

from phalanx.master.job.job import FINISHED, Job, RendezvousAnswer

__all__ = ["FINISHED", "Job", "RendezvousAnswer"]
