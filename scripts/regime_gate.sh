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
for _ in $(seq "$ROUNDS"); do
  for lr in $LRS; do
    dir=docs/study/regime${TAG:+-$TAG}-lr$lr
    if [ -f "$dir/study.json" ] && [ -n "$TAG" ]; then
      # a resumed study keeps its saved plan: refuse a TASK or TEMPERATURE other than it under the same TAG
      read -r saved_task saved_temperature < <(.venv/bin/python -c "import sys; \
from bapo.experiments.study import load_plan; from bapo.experiments.arith import task_spec; \
plan = load_plan(sys.argv[1]); print(task_spec(plan.task), plan.temperature)" "$dir")
      if [ -n "$TASK" ] && [ "$saved_task" != "$TASK" ]; then
        echo "$dir holds task $saved_task, not TASK=$TASK: use another TAG" >&2
        exit 2
      fi
      if [ -n "$TEMPERATURE" ] && ! .venv/bin/python -c "import sys; sys.exit(float(sys.argv[1]) != float(sys.argv[2]))" \
        "$saved_temperature" "$TEMPERATURE"; then
        echo "$dir holds temperature $saved_temperature, not TEMPERATURE=$TEMPERATURE: use another TAG" >&2
        exit 2
      fi
    fi
    if [ -f "$dir/study.json" ]; then
      "$BAPO" study --resume "$dir" --max-runs 1 --threads "$THREADS"
    else
      "$BAPO" study --regime ${TASK:+--task="$TASK"} ${TEMPERATURE:+--temperature "$TEMPERATURE"} --staleness 0 --delays '' --lr "$lr" --out "$dir" \
        --max-runs 1 --threads "$THREADS"
    fi
  done
done
