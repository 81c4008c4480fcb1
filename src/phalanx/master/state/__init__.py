"""What a job's master knows: the job's state record (:class:`~phalanx.master.state.jobstate.JobState`) and
the records it holds (nodes, events, the timeline, checkpoints, recoveries, counters), and its durable
snapshot. Written only by the job's writer (:class:`~phalanx.master.job.core.JobCore`)."""
