"""The contract shared by every phalanx component: the gRPC wire types (``phalanx.api.v1``), the
progress-beacon layout, settings and the error hierarchy. Imports nothing else of phalanx."""
