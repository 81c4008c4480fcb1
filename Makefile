# phalanx: the two commands a person needs are `make demo` and `make test`; both set up what they need.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.phalanx-setup
PROTO_GEN := scripts/gen-proto

.PHONY: setup lint test demo proto proto-check crds crds-check bench clean fmt

# Idempotent: a warm machine finds the stamp newer than pyproject.toml and returns at once.
setup: $(STAMP)
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install -q --disable-pip-version-check "uv>=0.6"
	$(BIN)/uv pip install -q -p $(BIN)/python -e '.[all]' --group dev
	@touch $(STAMP)

proto: setup
	$(BIN)/python $(PROTO_GEN)

proto-check: setup
	$(BIN)/python $(PROTO_GEN) --check

lint: setup proto-check
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

fmt: setup
	$(BIN)/ruff format src tests benchmarks examples scripts
	$(BIN)/ruff check --fix src tests benchmarks examples scripts

# pytest exits 5 when it collected nothing; that is a failure here, as is any other non-zero code.
test: setup lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

-include mk/*.mk
