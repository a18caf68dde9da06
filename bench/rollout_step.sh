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
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
read_only=0
if [ "${1:-}" = "--read" ]; then read_only=1; shift; fi
OUT=${1:?usage: bench/rollout_step.sh [--read] OUT [--json]}
JSON=${2:-}
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

"$PY" - "$OUT" "$JSON" <<'PYTHON'
import json, statistics, sys
from pathlib import Path

out, as_json = Path(sys.argv[1]), sys.argv[2] == "--json"
keys = {"step_s": "time/rollout_step_s", "rollout_s": "time/rollout_s", "sample_s": "time/vllm_sample_s",
        "push_s": "time/vllm_push_s", "update_s": "time/update_s"}
systems: dict[str, dict[str, list[float]]] = {}
for metrics in sorted(out.glob("*/metrics.jsonl")):
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][1:]  # step 0: the engine warms up
    base, _, repeat = metrics.parent.name.rpartition("-")  # new-1 and new-2 are one system; new-bf16 another
    system = systems.setdefault(base if repeat.isdigit() else metrics.parent.name, {name: [] for name in keys})
    for name, key in keys.items():
        system[name] += [row[key] for row in rows if isinstance(row.get(key), (int, float))]
medians = {name: {k: statistics.median(v) for k, v in parts.items() if v} for name, parts in systems.items()}
def ratio(a, b):
    return round(medians[a]["step_s"] / medians[b]["step_s"], 3) if a in medians and b in medians else None
result = {"systems": medians, "steps": {name: len(parts["step_s"]) for name, parts in systems.items()},
          "step_new_vs_old": ratio("old", "new"), "step_engine_vs_old": ratio("old", "engine"),
          "step_new_bf16_vs_old_bf16": ratio("old-bf16", "new-bf16"), "step_new_bf16_vs_old": ratio("old", "new-bf16")}
if as_json:
    print(json.dumps(result))
else:
    print("| system | steps | rollout step s | rollout s | vLLM sampling s | push s (share of the step) | update s |")
    print("|---|---|---|---|---|---|---|")
    for name, m in medians.items():
        push = f"{m['push_s']:.2f} ({m['push_s'] / m['step_s']:.1%})" if "push_s" in m else "-"
        print(f"| {name} | {result['steps'][name]} | {m['step_s']:.1f} | {m.get('rollout_s', float('nan')):.1f} | "
              f"{m.get('sample_s', float('nan')):.1f} | {push} | {m.get('update_s', float('nan')):.1f} |")
    for key in ("step_new_vs_old", "step_engine_vs_old", "step_new_bf16_vs_old_bf16", "step_new_bf16_vs_old"):
        print(f"{key} (old's median step over the other's; goal >= 2): {result[key]}")
PYTHON
