# krex — `make` lists the targets.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
EXTRAS  ?= dev,plot
TORCH   ?= torch==2.13.0
NATIVE  := $(shell find native -name '*.c' -o -name '*.h' -o -name '*.def' 2>/dev/null)

.DEFAULT_GOAL := help
.PHONY: help install demo test test-fast bench bench-chaos lint clean

help:  ## list the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z_-]+:.*## /{printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml setup.py $(NATIVE)
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	@# compat: a plain path entry, not setuptools' editable import finder, which site
	@# imports (pathlib, re, ...) at every Python start: ~20 ms of every krex command
	@# (docs/notes/startup.md).  Plain -e where a setuptools lacks the mode.
	$(VPY) -m pip install -q -e '.[$(EXTRAS)]' --config-settings editable_mode=compat \
	  || $(VPY) -m pip install -q -e '.[$(EXTRAS)]'
	@# torch's CPU build for the suite's torch paths, only from a wheel pip finds locally
	@# (find-links): PyPI's torch is a CUDA build of several GB.  Without one they skip.
	$(VPY) -m pip install -q --no-index --no-deps '$(TORCH)' 2>/dev/null \
	  && $(VPY) -m pip install -q '$(TORCH)' \
	  || echo "make install: no local wheel of $(TORCH): the torch tests will skip" \
	     "(pip install torch --index-url https://download.pytorch.org/whl/cpu)"
	@# Bytecode now, as pip does for a wheel: where PYTHONDONTWRITEBYTECODE is set, an
	@# editable install would otherwise compile krex from source at every command.
	$(VPY) -m compileall -q krex >/dev/null || true
	@touch $(STAMP)

install: $(STAMP)  ## create .venv and install krex (editable, builds the native parts)

demo: $(STAMP)  ## the main job: examples run concurrently under an auto-started daemon
	$(VENV)/bin/krex demo

TEST_WORKERS ?= 2
PYTEST  := $(VPY) -m pytest -q -rs -p no:cacheprovider --durations=10

test: $(STAMP)  ## run the whole test suite: the most in parallel, then the serial ones
	@# Two phases (tests/conftest.py's SERIAL: timing, hogs, node-wide cpusets need the
	@# machine to themselves).  Either failing, or collecting no tests (pytest's exit 5),
	@# fails the target.
	@$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial"; a=$$?; \
	$(PYTEST) -m serial; b=$$?; \
	echo "make test: parallel phase exit $$a, serial phase exit $$b"; \
	for rc in $$a $$b; do \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests in a phase: failing"; exit 1; fi; \
	  if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	done

test-fast: $(STAMP)  ## the tests not marked slow
	$(VPY) -m pytest -q -m "not slow"

bench: $(STAMP)  ## all benchmarks; results in results/, tables for docs/benchmarks.md
	$(VPY) benchmarks/run_all.py

bench-chaos: $(STAMP)  ## the daemon's chaos and load checks (results/chaos.json); SOAK_S=1800 adds the soak
	$(VPY) benchmarks/bench_chaos.py $(if $(SOAK_S),--soak-s $(SOAK_S))

lint: $(STAMP)  ## ruff and the type checker (mypy; both configured in pyproject.toml)
	$(VENV)/bin/ruff check krex tests benchmarks examples
	$(VENV)/bin/mypy

clean:  ## remove the venv and build outputs
	rm -rf $(VENV) build *.egg-info krex/_native/*.so* krex/_native/bin krex/_native/fakegpu results
