"""The per-job master: rendezvous, membership, heartbeats, failure policy, log aggregation, durable state,
and its gRPC (agents) and HTTP (people, Prometheus) servers. Never imports torch."""
