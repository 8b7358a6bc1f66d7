# Two entry points: `make demo` (main job) and `make test` (the suite CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install build demo test bench clean

$(STAMP): requirements.txt pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# Rebuilds realloc._C in place when csrc/ changed; a no-op otherwise.
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

# Tiny PPO on the local 2-device CPU cluster: search a plan, train 30 iterations (reward ~0.25 -> >0.8).
demo: build
	$(VENV)/bin/realloc run experiments/ppo_tiny.py --search-time 10 --iterations 30 --run-dir runs/demo

test: build
	$(PY) -m pytest -q

clean:
	rm -rf build realloc/*.so $(VENV)
