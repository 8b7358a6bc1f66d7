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

# The arithmetic demo on the local 2-device CPU cluster: GRPO with an exact-match reward on a searched plan,
# from the shipped SFT checkpoint (made through realloc; `--rebuild-sft` makes it again); prints held-out
# exact-match accuracy before and after (realloc/demo/arith_demo.py).
demo: build
	$(PY) -m realloc.demo.arith_demo

test: build
	$(PY) -m pytest -q

clean:
	rm -rf build realloc/*.so $(VENV)
