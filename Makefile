# make test: create the virtual environments from scratch (or reuse them when
# pyproject.toml has not changed), then run every test of every framework.
# make demo: set up, start 2 daemons on 127.0.0.1, train with 2 workers.

PYTHON ?= python3
VENV := .venv
VENV_MX := .venv-mxnet
STAMP := $(VENV)/.installed
STAMP_MX := $(VENV_MX)/.installed
# The C conversions, 8-bit formats, the daemon's summing pool, budget and data loop (setup.py): rebuilt in place
# when their source changes.
FASTWIRE := protos/python/reducer_wire/_kernels.c protos/python/reducer_wire/_quant.c \
	protos/python/reducer_wire/_quant_int8.c protos/python/reducer_wire/_quant_fp8.c \
	protos/python/reducer_wire/_quant.h \
	protos/python/reducer_wire/_fpmode.h \
	protos/python/reducer_wire/_codec.c protos/python/reducer_wire/_api.h \
	reducerd/core/_sumpool.c reducerd/core/_sumpool_threads.c reducerd/core/_sumpool_tasks.c \
	reducerd/core/_sumpool.h clients/reducer_client/transport/_tcploop.c \
	reducerd/core/_budget.c reducerd/core/_budget.h \
	reducerd/dataplane/_cplane.c reducerd/dataplane/_cplane_loop.c \
	reducerd/dataplane/_cplane_conn.c reducerd/dataplane/_cplane.h
BUILT := $(VENV)/.fastwire
BUILT_MX := $(VENV_MX)/.fastwire
PYTEST_ARGS ?=
# Two test processes (pytest-xdist), a file's tests in one of them: about 1.4x
# faster on 2 cores, as many tests wait on daemons, processes and timeouts.
# The adversarial probes, which bound memory, threads and times, run alone after.
PYTEST_PARALLEL ?= -n 2 --dist loadfile

.PHONY: all venv venv-mxnet build test test-main test-mxnet test-deploy test-adversarial demo proto lint \
	docs docs-cli docs-bench bench-docs clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[torch,tensorflow,frameworks,bench,dev,docs]"
	touch $@

$(STAMP_MX): pyproject.toml
	$(PYTHON) -m venv $(VENV_MX)
	$(VENV_MX)/bin/pip install --quiet --upgrade pip
	$(VENV_MX)/bin/pip install --quiet -e ".[mxnet,dev]"
	touch $@

$(BUILT): $(STAMP) $(FASTWIRE) setup.py
	$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

$(BUILT_MX): $(STAMP_MX) $(FASTWIRE) setup.py
	$(VENV_MX)/bin/pip install --quiet --no-deps -e .
	touch $@

venv: $(BUILT)
venv-mxnet: $(BUILT_MX)
build: $(BUILT)

test: test-main test-mxnet test-deploy

test-main: $(BUILT)
	$(VENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS) tests \
		--ignore=tests/deploy --ignore=tests/adversarial
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests/adversarial

# The units under a booted systemd and the image under Docker (tests/deploy): as
# root, alone (it boots a container and starts dockerd; not under make -j).
# REDUCER_SKIP_DEPLOY_TESTS=systemd,docker skips a part by name.
test-deploy: $(BUILT)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests/deploy

# Issue 16's probes at the sizes of its table (test-main runs them short):
# tests/adversarial/README.md lists each probe and its bound.
test-adversarial: $(BUILT)
	REDUCER_ADVERSARIAL=long $(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests/adversarial

# The core and the daemon under numpy 1.23 as well as numpy 2 in .venv: every
# unit test, the integration tests whose sums, 8-bit formats or codecs go through
# NumPy, and the MXNet shim. The protocol's faults, fuzz, access and node-local
# tests do not depend on NumPy's version; test-main runs them.
MX_INTEGRATION := tests/integration/test_core_allreduce.py tests/integration/test_quant_wire.py \
	tests/integration/test_summing_threads.py tests/integration/test_node_feedback.py \
	tests/integration/test_data_plane.py::test_tcp_grpc_and_numpy_codecs_give_the_same_bytes
test-mxnet: $(BUILT_MX)
	$(VENV_MX)/bin/python -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS) tests/unit \
		$(MX_INTEGRATION) tests/mxnet_shim -m "not slow"

demo: $(BUILT)
	$(VENV)/bin/python examples/demo.py

# The documentation site (MkDocs, Material theme), strict: a warning fails the build.
# The generated pages (CLI reference, benchmark results, README's figures) must be current.
docs: $(BUILT)
	$(VENV)/bin/python scripts/gen_cli_reference.py --check
	$(VENV)/bin/python scripts/gen_bench_pages.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Regenerate the command-line reference from the argument parsers.
docs-cli: $(BUILT)
	$(VENV)/bin/python scripts/gen_cli_reference.py

# Regenerate docs/benchmarks/*.md and README.md's figures from docs/benchmarks/data/.
docs-bench: $(BUILT)
	$(VENV)/bin/python scripts/gen_bench_pages.py

# Measure every benchmark the docs quote, then regenerate their pages: the list,
# each command and its run time (about 9 minutes on 2 cores in all) are in
# scripts/gen_bench_pages.py (`--list`). As root: the emulated cluster needs it.
bench-docs: $(BUILT)
	$(VENV)/bin/python scripts/gen_bench_pages.py --list
	$(VENV)/bin/python scripts/gen_bench_pages.py --run

proto: $(STAMP)
	$(VENV)/bin/python scripts/gen_proto.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(VENV_MX) .pytest_cache build site protos/python/reducer_wire/_kernels*.so \
		protos/python/reducer_wire/_quant*.so protos/python/reducer_wire/_codec*.so \
		reducerd/core/_sumpool*.so reducerd/core/_budget*.so reducerd/dataplane/_cplane*.so
