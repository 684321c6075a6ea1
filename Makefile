# Thin aliases; the scripts are the source of truth (CI runs .ci/run -> scripts/test.sh).
#   make setup | make test [ARGS='-k name'] | make up | make bench [BENCH_ARGS=...] | make lint | make lock
SHELL := /usr/bin/env bash
PYTHON ?= .venv/bin/python
BENCH_MODULE ?= bench
ARGS ?=
BENCH_ARGS ?=

.PHONY: setup test up bench lint lock

setup:
	bash scripts/setup.sh

test:
	bash scripts/test.sh $(ARGS)

up:
	bash scripts/up.sh $(ARGS)

# JAX (the `bench` extra) is a peer measured in the same run; it is not needed for tests.
bench:
	JACOBIAN_SETUP_EXTRAS=api,worker,test,bench bash scripts/setup.sh
	$(PYTHON) -m $(BENCH_MODULE) $(BENCH_ARGS)

lint:
	@if [ -x .venv/bin/ruff ]; then .venv/bin/ruff check .; \
	elif command -v ruff >/dev/null 2>&1; then ruff check .; \
	else echo "ruff is not installed: bash scripts/setup.sh (it comes with the test extra)"; fi

# After editing the dependencies in pyproject.toml: re-resolve uv.lock with the pinned uv, then commit it.
lock:
	bash scripts/uv.sh lock
