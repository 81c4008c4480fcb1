# phalanx: the two commands a person needs are `make demo` and `make test`; both set up what they need.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.phalanx-setup
PROTO_GEN := scripts/gen-proto
# `make test` runs pytest in this many lanes (pytest-xdist; tests/conftest.py says how tests are grouped).
# The suite waits on real processes and timers far more than it computes: one lane kept about 0.85 of one
# core busy, of the two. TEST_LANES=0 runs everything in this process, one test after another.
TEST_LANES ?= 2
# Python without a .py suffix (scripts) is named explicitly so ruff checks it too.
PY_SOURCES := src tests e2e benchmarks examples $(shell grep -l '^\#!/usr/bin/env python' scripts/* 2>/dev/null)

.PHONY: setup lint test proto proto-check bench clean fmt

# Idempotent: a warm machine finds the stamp newer than pyproject.toml and returns at once.
# Bytecode is compiled at install: with PYTHONDONTWRITEBYTECODE set (as on these machines, and in the image)
# or as a user who cannot write the venv (the test kubelet's Pods run as uid 10001), every process would
# otherwise compile torch from source again: `import torch, torch._dynamo` took 9-25 s instead of 3 s.
setup: $(STAMP)
$(STAMP): pyproject.toml hatch_build.py src/phalanx/_ringwrite.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install -q --disable-pip-version-check "uv>=0.6"
	$(BIN)/uv pip install -q --compile-bytecode -p $(BIN)/python -e '.[all]' --group dev
	@touch $(STAMP)

proto: setup
	$(BIN)/python $(PROTO_GEN)

proto-check: setup
	$(BIN)/python $(PROTO_GEN) --check

lint: setup proto-check crds-check chart-check
	$(BIN)/ruff check $(PY_SOURCES)
	$(BIN)/ruff format --check $(PY_SOURCES)
	$(BIN)/mypy
	$(BIN)/lint-imports

fmt: setup
	$(BIN)/ruff format $(PY_SOURCES)
	$(BIN)/ruff check --fix $(PY_SOURCES)

# The Kubernetes, Helm, Prometheus and MinIO tests run against binaries built from the official Go modules (the
# kubelet and kube-proxy of the container nodes, and CoreDNS, included); the first build takes ~15 minutes on 2
# cores, a warm cache returns at once. Without Go they skip loudly (fail under CI). The container images are
# built before pytest too (mk/images.mk).
# pytest exits 5 when it collected nothing; that is a failure here, as is any other non-zero code.
test: setup lint
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		scripts/k8s-binaries >/dev/null && scripts/helm-binary >/dev/null \
			&& scripts/prometheus-binary >/dev/null && scripts/minio-binary >/dev/null \
			&& scripts/coredns-binary >/dev/null; \
	else echo "WARNING: Go not found; the Kubernetes, Helm, Prometheus and S3 tests will be skipped (a failure under CI=true)"; fi
	@$(BIN)/python -m compileall -q src  # this checkout's own modules, for the same reason as in setup
	$(BIN)/python -m pytest -n $(TEST_LANES) --durations=30 $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m benchmarks.run_all
	$(BIN)/python -m benchmarks.report  # docs/benchmarks.md and its plots

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

-include mk/*.mk
