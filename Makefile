# Two entry points: `make demo` (main job) and `make test` (the suite CI runs).
# A first run installs the dependencies into .venv, then compiles realloc._C once; a second run builds nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The extension as compiled in place: realloc/_C.<this python's suffix>.so (the venv's python is $(PYTHON)).
EXT := realloc/_C$(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
CSRC := $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: install build demo test bench clean

# pip installs realloc editable without compiling (REALLOC_SKIP_EXT=1, setup.py): pip would build the extension
# in a temporary folder that `build_ext --inplace` cannot reuse, so it was compiled twice on a first run.
$(STAMP): requirements.txt pyproject.toml setup.py
	@echo "make: creating $(VENV) and installing the dependencies (torch CPU, megatron-core, transformers, ray, ...:"
	@echo "      about 1 GB to download on a first install; a few minutes, longer on a slow network)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install --progress-bar off -r requirements.txt
	REALLOC_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# Compiles realloc._C in place, once: again only when csrc/ or setup.py changed (make compares the times).
$(EXT): $(CSRC) setup.py | $(STAMP)
	@echo "make: compiling realloc._C from csrc/ (its C++ files at -O3, on every core: about a minute on 2 free cores," \
	      "a few minutes on a busy machine)"
	@start=$$(date +%s); $(PY) setup.py -q build_ext --inplace && touch $@ && \
	  echo "make: realloc._C compiled in $$(( $$(date +%s) - start )) s"

build: $(EXT)

# The arithmetic demo on the local 2-device CPU cluster: GRPO with an exact-match reward on a searched plan,
# from the shipped SFT checkpoint (made through realloc; `--rebuild-sft` makes it again); prints held-out
# exact-match accuracy before and after (realloc/demo/arith_demo.py).
demo: build
	$(PY) -m realloc.demo.arith_demo

test: build
	$(PY) -m pytest -q

clean:
	rm -rf build realloc/*.so $(VENV)
