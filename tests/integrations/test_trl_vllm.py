"""BAPOGRPOTrainer with TRL's colocated vLLM (use_vllm=True, vllm_mode="colocate") on CPU (marker
`vllm`; skipped when vllm is not importable). TRL's own weight sync calls vLLM's
`model.load_weights`, which fails on CPU (packed linear weights); BAPOGRPOTrainer pushes through
bapo.train.vllm_engine.push_weights there instead. The run goes in its own process (one vLLM
engine per process): 3 optimizer steps, a generation before the first and after the second (a
push of updated weights); TRL's logged engine-vs-trainer gap stays small."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import json_from_module

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install bapo[vllm])"
    ),
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed"),
]


def run(work: str) -> list[dict]:
    from datasets import Dataset

    from bapo.integrations.trl import BAPOGRPOConfig, BAPOGRPOTrainer
    from bapo.train.tiny import ModelConfig, save_tiny_model
    from examples.trl.tiny_task import addition_prompts, digit_match_reward
    from tests.helpers import cpu_grpo_args

    model = save_tiny_model(Path(work) / "model", ModelConfig(hidden_size=256, heads=4, intermediate_size=512))
    args = BAPOGRPOConfig(
        **cpu_grpo_args(
            Path(work) / "out",
            num_generations=4,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            steps_per_generation=4,
            max_completion_length=8,
            max_steps=3,
            use_vllm=True,
            vllm_mode="colocate",
            vllm_max_model_length=64,
            vllm_importance_sampling_correction=True,
        )
    )
    trainer = BAPOGRPOTrainer(
        model=str(model),
        reward_funcs=digit_match_reward,
        args=args,
        train_dataset=Dataset.from_list(addition_prompts(32)),
    )
    trainer.train()
    return [row for row in trainer.state.log_history if "loss" in row]


def test_bapo_grpo_trainer_with_colocated_vllm_on_cpu(tmp_path):
    rows = json_from_module(
        "tests.integrations.test_trl_vllm",
        str(tmp_path),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    print(rows)
    generations = [row for row in rows if "sampling/sampling_logp_difference/max" in row]
    assert len(rows) == 3 and len(generations) == 2  # the second after two updates: a push of new weights
    for row in generations:
        assert row["sampling/sampling_logp_difference/max"] < 0.02
    assert all("bapo/search/lower" in row for row in rows)


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
