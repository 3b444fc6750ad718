# dra-agent: `make demo` runs the agent on the fake backend; `make test` runs every check.
# Both work on a fresh machine with only python3: they create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_OUT := agent/kubelet/_protos

.PHONY: all venv demo test lint typecheck unit protos bench clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,nvidia]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/dra-agent demo

lint: $(STAMP)
	$(BIN)/ruff check agent backends tests benchmarks
	$(BIN)/ruff format --check agent backends tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck unit

protos: $(STAMP)
	$(BIN)/python -m agent.kubelet.protogen

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) build *.egg-info
