# make test: create the virtual environments from scratch (or reuse them when
# pyproject.toml has not changed), then run every test of every framework.
# make demo: set up, start 2 daemons on 127.0.0.1, train with 2 workers.

PYTHON ?= python3
VENV := .venv
VENV_MX := .venv-mxnet
STAMP := $(VENV)/.installed
STAMP_MX := $(VENV_MX)/.installed
PYTEST_ARGS ?=

.PHONY: all venv venv-mxnet test test-main test-mxnet demo proto lint clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[torch,tensorflow,bench,dev]"
	touch $@

$(STAMP_MX): pyproject.toml
	$(PYTHON) -m venv $(VENV_MX)
	$(VENV_MX)/bin/pip install --quiet --upgrade pip
	$(VENV_MX)/bin/pip install --quiet -e ".[mxnet,dev]"
	touch $@

venv: $(STAMP)
venv-mxnet: $(STAMP_MX)

test: test-main test-mxnet

test-main: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests

# The core runs under numpy 1.23 here as well as numpy 2 in .venv.
test-mxnet: $(STAMP_MX)
	$(VENV_MX)/bin/python -m pytest -q $(PYTEST_ARGS) tests/unit tests/integration tests/mxnet_shim \
		-m "not slow"

demo: $(STAMP)
	$(VENV)/bin/python examples/demo.py

proto: $(STAMP)
	$(VENV)/bin/python scripts/gen_proto.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(VENV_MX) .pytest_cache
