"""The master process: its gRPC service for agents, its HTTP API for people and Prometheus, request
validation, log aggregation, and the executor that owns the job and does its I/O."""
