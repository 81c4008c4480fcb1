"""``phalanx local``: a single-machine cluster that runs a master and N node agents, carries out evictions
and replacements, and injects faults for chaos testing."""
