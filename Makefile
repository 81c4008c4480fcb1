# phalanx: the two commands a person needs are `make demo` and `make test`; both set up what they need.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.phalanx-setup
PROTO_GEN := scripts/gen-proto
# `make test` runs pytest in this many lanes (pytest-xdist; tests/conftest.py says how tests are grouped).
# The suite waits on real processes and timers as much as it computes: with two lanes the 2-core machine was
# 82 % busy and pytest took 29 minutes, with three 93 % and 22 minutes. TEST_LANES=0 runs everything in this
# process, one test after another.
TEST_LANES ?= 3
# Python without a .py suffix (scripts) is named explicitly so ruff checks it too.
PY_SOURCES := src tests e2e benchmarks examples $(shell grep -l '^\#!/usr/bin/env python' scripts/* 2>/dev/null)

.PHONY: setup lock lock-check lint test test-prepare e2e-prepare readme-check proto proto-check openapi openapi-check bench dist clean fmt

# The venv is exactly uv.lock: every extra and the dev group, phalanx itself editable. --locked fails when
# uv.lock no longer matches pyproject.toml (`make lock` updates it; docs/development.md says when).
# Idempotent: a warm machine finds the stamp newer than pyproject.toml and uv.lock and returns at once.
# Bytecode is compiled at install: with PYTHONDONTWRITEBYTECODE set (as on these machines, and in the image)
# or as a user who cannot write the venv (the test kubelet's Pods run as uid 10001), every process would
# otherwise compile torch from source again: `import torch, torch._dynamo` took 9-25 s instead of 3 s.
# uv itself is in the lock (the dev group); the bootstrap installs that version.
UV_VERSION = $(shell awk '$$0 == "name = \"uv\"" {getline; gsub(/"/, "", $$3); print $$3; exit}' uv.lock)
setup: $(STAMP)
$(STAMP): pyproject.toml uv.lock hatch_build.py src/phalanx/_ringwrite.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install -q --disable-pip-version-check "uv==$(UV_VERSION)"
	$(BIN)/uv sync -q --locked --all-extras --compile-bytecode -p $(BIN)/python
	@touch $(STAMP)

# uv.lock again from pyproject.toml (after a change to a dependency or a range), and the images' requirement
# files exported from it; `make lock-check` (part of lint) fails when either is out of date.
lock: setup
	$(BIN)/uv lock
	$(BIN)/python scripts/export-requirements

lock-check: setup
	$(BIN)/uv lock --check
	$(BIN)/python scripts/export-requirements --check

proto: setup
	$(BIN)/python $(PROTO_GEN)

proto-check: setup
	$(BIN)/python $(PROTO_GEN) --check

# docs/master-api.json, the OpenAPI schema of a master's HTTP API, from the views it serves.
openapi: setup
	$(BIN)/python scripts/gen-openapi

openapi-check: setup
	$(BIN)/python scripts/gen-openapi --check

lint: setup lock-check proto-check crds-check chart-check openapi-check
	$(BIN)/ruff check $(PY_SOURCES)
	$(BIN)/ruff format --check $(PY_SOURCES)
	$(BIN)/mypy
	$(BIN)/lint-imports

fmt: setup
	$(BIN)/ruff format $(PY_SOURCES)
	$(BIN)/ruff check --fix $(PY_SOURCES)

# The Kubernetes, Helm, Prometheus and MinIO tests run against binaries built from the official Go modules (the
# kubelet and kube-proxy of the container nodes, and CoreDNS, included), the image tests and e2e scenarios
# against images built here and imported into the container nodes: scripts/prepare-tests does all of it
# before pytest starts, each stage timed (cold: tens of minutes on 2 cores; warm: seconds), so that no test's
# timeout pays for a cold machine. Without Go or root the tests that need them skip loudly (fail under CI).
# pytest exits 5 when it collected nothing; that is a failure here, as is any other non-zero code.
# scripts/run-tests runs up to 5 tests that failed under the suite's load once more, alone, and names those
# that pass then as flaky under load (a race to fix at its cause); a test that fails alone too fails the run.
# The scenarios of e2e/ on the container cluster are `make e2e`'s, not this target's (CI runs both): they are
# a cluster of real kubelets and containerd run for minutes, and the other half of the suite's CPU on 2 cores.
test: setup lint test-prepare
	@$(BIN)/python -m compileall -q src  # this checkout's own modules, for the same reason as in setup
	$(BIN)/python scripts/run-tests -n $(TEST_LANES) --durations=30 tests $(PYTEST_ARGS)

test-prepare: setup host-packages
	@scripts/prepare-tests

# What `make e2e` on this machine's container nodes needs besides: the images imported into the nodes.
e2e-prepare: setup host-packages
	@scripts/prepare-tests --e2e

# The README's commands as a reader types them (`make k8s-up`, `kubectl apply -f examples/elasticjob.yaml`,
# `make k8s-down`, `make demo`); CI runs it after `make test`.
readme-check: e2e-prepare
	@scripts/readme-check

# Every benchmark, side by side with its peers, into benchmarks/results/ and docs/benchmarks.md (hours).
# `make bench QUICK=1`: each once and small, into benchmarks/results/quick/ (minutes; CI runs it).
bench: setup
ifdef QUICK
	$(BIN)/python -m benchmarks.run_all --quick
else
	$(BIN)/python -m benchmarks.run_all
	$(BIN)/python -m benchmarks.report  # docs/benchmarks.md and its plots
endif

# What to install into a training image of your own: the source distribution and one wheel per CPython 3.11
# or later on this machine, each with the C interval writer (scripts/dist says which Pythons it found).
dist: setup
	@scripts/dist

clean:
	rm -rf $(VENV) .venv-torch-oldest .venv-py3.* dist .mypy_cache .ruff_cache .pytest_cache

-include mk/*.mk
