"""Generated protobuf and gRPC code for proto/phalanx/v1 (`make proto`); do not edit by hand."""
