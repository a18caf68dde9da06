#!/usr/bin/env bash
# BAPO inside verl 0.9 on a GPU cluster: bapo_grpo.yaml (the paper's settings) plus your paths.
# Not run in CI. Every node needs: pip install "bapo[verl]" vllm  (bapo registers its losses in
# each verl worker through the verl.plugins entry point and the config's _target_).
#
#   MODEL_PATH=/ckpt/Qwen2.5-7B TRAIN_FILES=/data/train.parquet VAL_FILES=/data/aime24.parquet \
#   NNODES=2 bash examples/verl/run_bapo.sh trainer.total_epochs=10
#
# CONFIG=bapo_grpo (default: the paper's settings) or CONFIG=bapo_recipe (the public recipe's search).
# STALENESS=E (the paper's staleness E): E+1 updates per rollout batch (mini-batches of
# TRAIN_PROMPTS/(E+1) prompts), so the last update trains on data E updates old. Extra arguments are Hydra overrides for verl.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to a Hugging Face checkpoint directory}
TRAIN_FILES=${TRAIN_FILES:?set TRAIN_FILES to a parquet file in verl RL format}
VAL_FILES=${VAL_FILES:-$TRAIN_FILES}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAIN_PROMPTS=${TRAIN_PROMPTS:-256}
STALENESS=${STALENESS:-3}
PPO_EPOCHS=${PPO_EPOCHS:-1}
CONFIG=${CONFIG:-bapo_grpo}
PROJECT=${PROJECT:-bapo}
EXPERIMENT=${EXPERIMENT:-bapo-staleness${STALENESS}}

UPDATES=$((STALENESS + 1))
if (( TRAIN_PROMPTS % UPDATES != 0 )); then
  echo "TRAIN_PROMPTS=$TRAIN_PROMPTS must be divisible by STALENESS+1=$UPDATES" >&2
  exit 2
fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

command=(python3 -m verl.trainer.main_ppo
  --config-path="$HERE" --config-name="$CONFIG"
  data.train_files="$TRAIN_FILES"
  data.val_files="$VAL_FILES"
  data.train_batch_size="$TRAIN_PROMPTS"
  actor_rollout_ref.model.path="$MODEL_PATH"
  actor_rollout_ref.actor.ppo_mini_batch_size=$((TRAIN_PROMPTS / UPDATES))
  actor_rollout_ref.actor.ppo_epochs="$PPO_EPOCHS"
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6
  trainer.logger='["console","wandb"]'
  trainer.project_name="$PROJECT"
  trainer.experiment_name="$EXPERIMENT"
  trainer.nnodes="$NNODES"
  trainer.n_gpus_per_node="$GPUS_PER_NODE"
  "$@")

# DRY_RUN=1 prints the command, one argument per line (the CPU test composes the config from it).
if [[ -n ${DRY_RUN:-} ]]; then
  printf '%s\n' "${command[@]}"
else
  exec "${command[@]}"
fi
