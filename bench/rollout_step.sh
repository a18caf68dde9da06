#!/usr/bin/env bash
# Issue 36's rollout step with vLLM, side by side in one run: `bapo train` at the regime study's shapes
# (bench/rollout_step.yaml) for a few rollout steps per system, each system's own timers
# (metrics.jsonl: time/rollout_step_s = rollout + update; the rollout = vLLM sampling + weight push +
# the trainer's behaviour log-probs), medians over every step but the first (the engine's warm-up).
#   BASELINE_SRC=/tmp/baseline36/src bash bench/rollout_step.sh OUT [--json]   # run, then the table
#   bash bench/rollout_step.sh --read OUT [--json]                             # the table of OUT's runs
# BASELINE_SRC: another bapo source tree ("today": git archive 9778751 src | tar -x -C /tmp/baseline36);
# without it the baseline systems are skipped. Systems, in this order (each one after the other, so
# load drifts across them; the baseline and main alternate): new (main, recompute), old, engine (main,
# rollout.behaviour_log_prob=engine), old, new, then old-bf16 and new-bf16 (model.autocast=bfloat16:
# worth it only where the CPU computes bf16 natively). Needs vLLM (make vllm) and bapo smollm2's folder.
set -euo pipefail
usage="usage: bench/rollout_step.sh [--read] OUT [--json]"
read_only=0
if [ "${1:-}" = "--read" ]; then read_only=1; shift; fi
case "${1:-}" in
  "" | -*) echo "$usage" >&2; exit 2 ;;
esac
OUT=$(realpath -m "$1")   # before the cd below: OUT is relative to the caller's folder
JSON=${2:-}
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-$HOME/.cache/bapo/smollm2-135m-instruct}
DATA=${DATA:-docs/study/regime-lr1e-5/data/train.jsonl}
STEPS=${STEPS:-4}
THREADS=${THREADS:-2}

run() {  # name source-tree overrides...
  local name=$1 src=$2; shift 2
  echo "== $name $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)" >&2
  OMP_NUM_THREADS=$THREADS VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 PYTHONPATH=$src \
    "$PY" -m bapo.cli.main train bench/rollout_step.yaml model.path="$MODEL" data.path="$DATA" \
    run.rollout_steps="$STEPS" run.output_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
}

if [ "$read_only" = 0 ]; then
  mkdir -p "$OUT"
  old=()
  if [ -n "${BASELINE_SRC:-}" ]; then
    # the task's verifier lived in bapo.demo.arith before the experiments package (issue 35)
    old=(reward.verifier=bapo.demo.arith:verify)
  fi
  run new-1 src
  [ -n "${BASELINE_SRC:-}" ] && run old-1 "$BASELINE_SRC" "${old[@]}"
  run engine-1 src rollout.behaviour_log_prob=engine
  [ -n "${BASELINE_SRC:-}" ] && run old-2 "$BASELINE_SRC" "${old[@]}"
  run new-2 src
  [ -n "${BASELINE_SRC:-}" ] && run old-bf16 "$BASELINE_SRC" "${old[@]}" model.autocast=bfloat16
  run new-bf16 src model.autocast=bfloat16
fi

"$PY" - "$OUT" "$JSON" "$STEPS" <<'PYTHON'
# the table: each system's rollout steps but the first (the engine's warm-up), medians of the
# trainer's own timers as the study report reads them (bapo.analysis.runs)
import json, sys
from pathlib import Path

from bapo.analysis.runs import Run, step_time_summary
from bapo.train.metrics import read_metrics

out, as_json, planned = Path(sys.argv[1]), sys.argv[2] == "--json", int(sys.argv[3])
steps: dict[str, list[dict]] = {}
for metrics in sorted(out.glob("*/metrics.jsonl")):
    run = Run(metrics.parent, "grpo", "", 0, read_metrics(metrics.parent))
    timed = run.rollout_step_times()[1:]
    if len(timed) < planned - 1:
        print(f"warning: {metrics.parent.name} has {len(timed)} timed rollout steps of {planned - 1}", file=sys.stderr)
    base, _, repeat = metrics.parent.name.rpartition("-")  # new-1 and new-2 are one system; new-bf16 another
    steps.setdefault(base if repeat.isdigit() else metrics.parent.name, []).extend(timed)
summaries = {name: step_time_summary(timed) for name, timed in steps.items() if timed}
if not summaries:
    sys.exit(f"no timed rollout step under {out} (runs are OUT/<system>-<n>/metrics.jsonl)")


def speedup(baseline: str, system: str):  # the baseline's median rollout step over the system's
    if baseline in summaries and system in summaries:
        return round(summaries[baseline]["step_s"] / summaries[system]["step_s"], 3)
    return None


result = {
    "systems": summaries,
    "steps": {name: len(timed) for name, timed in steps.items()},
    "speedup_new_over_old": speedup("old", "new"),
    "speedup_engine_over_old": speedup("old", "engine"),
    "speedup_new_bf16_over_old_bf16": speedup("old-bf16", "new-bf16"),
    "speedup_new_bf16_over_old": speedup("old", "new-bf16"),
}
if as_json:
    print(json.dumps(result))
else:
    print("| system | rollout steps | rollout step s | rollout s | vLLM sampling s | push s (share of its step) | updates s |")
    print("|---|---|---|---|---|---|---|")
    for name, m in summaries.items():
        push = f"{m['push_s']:.2f} ({m['push_share']:.1%})" if "push_share" in m else "-"
        print(
            f"| {name} | {result['steps'][name]} | {m['step_s']:.1f} | {m.get('rollout_s', float('nan')):.1f} | "
            f"{m.get('sample_s', float('nan')):.1f} | {push} | {m.get('update_s', float('nan')):.1f} |"
        )
    for key, value in result.items():
        if key.startswith("speedup"):
            print(f"{key} (median rollout step, goal >= 2): {value}")
PYTHON
