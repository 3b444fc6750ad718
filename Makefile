# dra-agent: `make demo` runs the agent on the fake backend; `make test` runs every check.
# Both work on a fresh machine with only python3: they create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_OUT := agent/kubelet/_protos

.PHONY: all venv demo test lint typecheck unit promtool amd-standin nvidia-floor protos bench clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,nvidia,amd]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/dra-agent demo

lint: $(STAMP)
	$(BIN)/ruff check agent backends tests benchmarks
	$(BIN)/ruff format --check agent backends tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP) promtool amd-standin
	$(BIN)/python -m pytest -q

# promtool runs the alert-rule tests (they skip without it). Taken from Debian's prometheus package
# into .venv/bin, binary only (no Prometheus server installed); as root, refreshes the package
# lists when needed. Never fails the build.
promtool: $(STAMP)
	@if command -v promtool >/dev/null 2>&1 || [ -x $(BIN)/promtool ]; then exit 0; fi; \
	tmp=$$(mktemp -d); \
	( cd $$tmp && { apt-get download -qq prometheus || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get download -qq prometheus; }; } ) >/dev/null 2>&1 && \
	dpkg-deb --fsys-tarfile $$tmp/prometheus_*.deb 2>/dev/null | tar -xO ./usr/bin/promtool >$$tmp/promtool 2>/dev/null && \
	install -m 0755 $$tmp/promtool $(BIN)/promtool; \
	rm -rf $$tmp; \
	[ -x $(BIN)/promtool ] || echo "promtool unavailable: the alert-rule tests are skipped (apt-get install prometheus)"

# The AMD tests load AMD's real amdsmi over a stand-in libamd_smi.so built from C
# (tests/fakes/amdsmi_standin) into build/amd-standin; as root, installs a C compiler when missing.
amd-standin: $(STAMP)
	@command -v cc >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  { apt-get install -y -qq gcc >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq gcc >/dev/null 2>&1; }; }; } || \
	  echo "no C compiler: the AMD tests cannot build their stand-in library (apt-get install gcc)"
	$(BIN)/python -c "from tests.fakes.amd_standin import build; [build(v) for v in ('full', 'no-cper')]"

test: lint typecheck unit nvidia-floor

# The NVIDIA tests again on the oldest nvidia-ml-py pyproject.toml allows (`unit` runs the newest):
# pynvml is one module, installed apart and put first on the path.
NVML_FLOOR := $(shell sed -n 's/.*"nvidia-ml-py>=\([0-9.]*\)".*/\1/p' pyproject.toml)
NVML_FLOOR_DIR := $(VENV)/nvml-floor-$(NVML_FLOOR)
nvidia-floor: $(STAMP)
	@[ -f $(NVML_FLOOR_DIR)/pynvml.py ] || \
	  $(BIN)/python -m pip install --quiet --no-deps --target $(NVML_FLOOR_DIR) 'nvidia-ml-py==$(NVML_FLOOR)'
	PYTHONPATH=$(NVML_FLOOR_DIR) $(BIN)/python -c 'import pynvml, sys; sys.exit(pynvml.__file__.find("nvml-floor") < 0)'
	PYTHONPATH=$(NVML_FLOOR_DIR) $(BIN)/python -m pytest -q tests/nvidia

protos: $(STAMP)
	$(BIN)/python -m agent.kubelet.protogen

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) build *.egg-info
