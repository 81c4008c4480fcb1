"""Benchmarks that run phalanx side by side with its peers and print JSON (`make bench`)."""
