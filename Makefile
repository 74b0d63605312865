# Two commands on a fresh machine (Python 3.11+ and make): `make demo` and `make test`.
# Both create .venv on first use and reuse it afterwards.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvq-installed
# the CPU build of torch; pip finds it on PyPI (or a local wheel mirror)
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-fast lint bench clean

$(STAMP): pyproject.toml setup.py
	$(PY) -c 'import sys; sys.exit("kvq needs Python >= 3.11") if sys.version_info < (3, 11) else None'
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,server]"
	# the API's client tests (openai's, langchain's, litellm's, lm-eval's): skipped where missing
	$(BIN)/python -m pip install -q -e ".[clients]" || echo "kvq: the client extra did not install; its tests will be skipped"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/kvq demo

# the second run: the end-to-end and fault tests again, on a local 3-master Redis Cluster
CLUSTER_SUITE := tests/bus/test_shards.py tests/integration/test_e2e_generation.py tests/integration/test_e2e_refusals.py \
	tests/integration/test_e2e_replay.py tests/integration/test_e2e_faults.py tests/integration/test_multi_slice.py \
	tests/integration/test_e2e_key_loss.py tests/integration/test_e2e_forged_results.py

# pytest-xdist: a pytest process a CPU, each with its own Redis, a test module at a time (its
# module-scoped setup made once); XDIST= runs in one process. The tests marked `serial` then
# run alone (exit 5: none selected)
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider
XDIST ?= -n auto --dist loadscope

test: setup
	$(PYTEST) $(XDIST) -m "not serial" --durations=25
	$(PYTEST) -m serial || [ $$? = 5 ]
	CLUSTER_TESTS=1 $(PYTEST) $(XDIST) -m "not standalone" $(CLUSTER_SUITE)

test-fast: setup
	$(PYTEST) $(XDIST) -m "not slow and not serial"
	$(PYTEST) -m "serial and not slow" || [ $$? = 5 ]

lint: setup
	$(BIN)/ruff check kvq tests
	$(BIN)/ruff format --check kvq tests
	$(BIN)/mypy kvq

bench: setup
	$(BIN)/kvq bench bus --json

clean:
	rm -rf $(VENV) *.egg-info
