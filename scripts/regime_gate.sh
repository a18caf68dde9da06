#!/usr/bin/env bash
# The regime gate's learning-rate choice (docs/STUDY.md, "The regime gate"): on-policy GRPO in the
# regime plan (`bapo study --regime`: 64-token budget, 8 x 8, 40 rollout steps) at each candidate lr,
# one run per study in turn, so that a partial gate compares the learning rates at equal seeds.
# Resumable: run it again and each study continues (finished runs skipped, a started one from its
# last checkpoint). One study process at a time: a run's vLLM engine and trainer hold ~10 GB.
#   nice -n 19 bash scripts/regime_gate.sh            # LRS="1e-5 3e-6" ROUNDS=3 THREADS=2
#   TASK='*:2-19:2-29:64' TAG=mul LRS=3e-6 nice -n 19 bash scripts/regime_gate.sh   # another task space
#     (bapo study --task; folders docs/study/regime-TAG-lrLR)
#   TEMPERATURE=1.0 TAG=t1 LRS=3e-6 nice -n 19 bash scripts/regime_gate.sh   # another sampling temperature
set -euo pipefail
cd "$(dirname "$0")/.."
BAPO=${BAPO:-.venv/bin/bapo}
LRS=${LRS:-"3e-6 1e-5"}
ROUNDS=${ROUNDS:-3}   # the plan's seeds
THREADS=${THREADS:-2}
TASK=${TASK:-}        # empty: the regime plan's task (+:2-19:2-29:64)
TEMPERATURE=${TEMPERATURE:-}  # empty: the plan's 0.7
TAG=${TAG:-}
if { [ -n "$TASK$TEMPERATURE" ] && [ -z "$TAG" ]; } || { [ -z "$TASK$TEMPERATURE" ] && [ -n "$TAG" ]; }; then
  echo "TASK or TEMPERATURE goes with TAG: TASK=<op:a-range:b-range:budget> and/or TEMPERATURE=<t>," \
    "TAG=<short name> (docs/study/regime-TAG-lrLR)" >&2
  exit 2
fi
PYTHON=${PYTHON:-$(dirname "$BAPO")/python}
# before any run: a resumed study keeps its saved plan, so refuse a folder whose task or temperature is
# not the one asked for (TASK / TEMPERATURE, or the regime plan's when unset): pick another TAG instead
for lr in $LRS; do
  dir=docs/study/regime${TAG:+-$TAG}-lr$lr
  [ -f "$dir/study.json" ] || continue
  "$PYTHON" - "$dir" "$TASK" "$TEMPERATURE" <<'PY' || exit 2
import sys

from bapo.experiments.arith import task_spec
from bapo.experiments.study import PROFILES, load_plan

folder, task, temperature = sys.argv[1:]
plan, default = load_plan(folder), PROFILES["regime"]
try:
    wanted_temperature = float(temperature) if temperature else default.temperature
except ValueError:
    sys.exit(f"TEMPERATURE={temperature}: a number above 0 expected, e.g. 1.0")
wanted_task = task or task_spec(default.task)
unset = " (unset: the regime plan's)"
if task_spec(plan.task) != wanted_task:
    sys.exit(f"{folder} holds task {task_spec(plan.task)}, not {wanted_task}{'' if task else unset}: use another TAG")
if plan.temperature != wanted_temperature:
    sys.exit(
        f"{folder} holds temperature {plan.temperature}, not {wanted_temperature}{'' if temperature else unset}: "
        "use another TAG"
    )
PY
done
for _ in $(seq "$ROUNDS"); do
  for lr in $LRS; do
    dir=docs/study/regime${TAG:+-$TAG}-lr$lr
    if [ -f "$dir/study.json" ]; then
      "$BAPO" study --resume "$dir" --max-runs 1 --threads "$THREADS"
    else
      "$BAPO" study --regime ${TASK:+--task="$TASK"} ${TEMPERATURE:+--temperature "$TEMPERATURE"} --staleness 0 --delays '' --lr "$lr" --out "$dir" \
        --max-runs 1 --threads "$THREADS"
    fi
  done
done
