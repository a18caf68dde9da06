#!/usr/bin/env bash
# GPU checks (CI has no GPU): the CUDA-marked tests, then the core bench on the device.
# Run on a CUDA machine from the repo root with a CUDA build of torch in .venv:
#   make .venv/.test VLLM=0 TORCH="torch==2.9.1" && scripts/gpu_check.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PY" -m pytest -q -m gpu
# Trainer bench on the device (bapo vs TRL GRPOTrainer, rollout/update tok/s and the overhead ratios):
"$PY" bench/trainer.py --device cuda --hidden 256 --layers 4 --new-tokens 64 --json
