"""bapo inside TRL's GRPOTrainer, on CPU with a tiny config-built Llama and a char tokenizer.

Two kinds of checks:
- loss checks on hand-built TRL micro-batches (old log-probs perturbed so that ratios differ
  from 1 and clipping happens): the subclass equals bapo.core, and with method="grpo" and TRL's
  bounds it equals TRL's own loss for every supported loss_type;
- a short real training run (steps_per_generation > gradient_accumulation_steps and
  num_iterations > 1) whose log holds the bapo/ metrics.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from bapo.core import (  # noqa: E402
    BAPOConfig,
    TokenBatch,
    clip_statistics,
    policy_loss,
    positive_share,
    search_bounds,
    token_ratio,
)
from bapo.integrations.trl import BAPOGRPOConfig, BAPOGRPOTrainer  # noqa: E402
from bapo.integrations.trl.config import BAPO_DUAL_CLIP  # noqa: E402
from bapo.integrations.trl.trainer import group_split, starts_optimizer_step  # noqa: E402
from examples.trl.tiny_task import addition_prompts, build_tiny_model, digit_match_reward  # noqa: E402
from tests.helpers import cpu_grpo_args  # noqa: E402

GROUP = 4
MICRO_BATCH = 4
ACCUMULATION = 2
STEPS_PER_GENERATION = 4


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


def make_args(tmp_path, **overrides) -> BAPOGRPOConfig:
    settings = cpu_grpo_args(
        tmp_path / "out",
        num_generations=GROUP,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        steps_per_generation=STEPS_PER_GENERATION,
        max_completion_length=8,
    )
    return BAPOGRPOConfig(**{**settings, **overrides})


def make_trainer(tiny_model_dir, tmp_path, trainer_class=BAPOGRPOTrainer, **overrides) -> BAPOGRPOTrainer:
    dataset = Dataset.from_list(addition_prompts(64))
    return trainer_class(
        model=tiny_model_dir,
        reward_funcs=digit_match_reward,
        args=make_args(tmp_path, **overrides),
        train_dataset=dataset,
    )


def micro_batch(trainer, generator: torch.Generator, completion_len: int = 6, noise: float = 0.4) -> dict:
    """A TRL micro-batch by hand: random prompts/completions, old log-probs = current ones + noise."""
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (MICRO_BATCH, 4), generator=generator)
    completion_ids = torch.randint(3, vocab, (MICRO_BATCH, completion_len), generator=generator)
    lengths = torch.randint(2, completion_len + 1, (MICRO_BATCH, 1), generator=generator)
    completion_mask = (torch.arange(completion_len) < lengths).long()
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(MICRO_BATCH, generator=generator),
    }
    with torch.no_grad():
        log_prob = trainer._completion_log_probs(trainer.model, batch)[0]
    batch["old_per_token_logps"] = log_prob + noise * torch.randn(log_prob.shape, generator=generator)
    return batch


def generation_buffer(trainer, seed: int = 0) -> list[dict]:
    """steps_per_generation micro-batches as TRL buffers them (num_items_in_batch: tokens of all of them)."""
    generator = torch.Generator().manual_seed(seed)
    buffer = [micro_batch(trainer, generator) for _ in range(STEPS_PER_GENERATION)]
    tokens = sum(batch["completion_mask"].sum() for batch in buffer)
    for batch in buffer:
        batch["num_items_in_batch"] = tokens
    return buffer


def current_log_prob(trainer, batch):
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
            batch["completion_ids"].size(1),
            compute_entropy=True,
        )[:2]


def start_optimizer_step(trainer, buffer, step: int) -> None:
    trainer.model.train()
    trainer._buffered_inputs = buffer
    trainer._step = step
    trainer.current_gradient_accumulation_steps = ACCUMULATION


def test_config_mirrors_core_bapo_config(tmp_path):
    args = make_args(tmp_path, bapo_target=0.55, bapo_upper_max=2.0, bapo_order="lower-first")
    assert args.bapo_config() == dataclasses.replace(BAPOConfig(), target=0.55, upper_max=2.0, order="lower-first")
    for spec in dataclasses.fields(BAPOConfig):
        assert hasattr(args, f"bapo_{spec.name}"), spec.name
    assert args.bapo_loss_agg_mode == "token-mean"  # TRL's default loss_type "dapo"
    grpo = make_args(tmp_path, bapo_method="grpo", epsilon=0.2, epsilon_high=0.28)
    assert grpo.bapo_loss_params() == pytest.approx({"lower": 0.8, "upper": 1.28})


@pytest.mark.parametrize(
    "overrides, field_name",
    [
        ({"loss_type": "sapo"}, "loss_type"),
        ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
        ({"delta": 3.0}, "delta"),
        ({"bapo_method": "gpro"}, "bapo_method"),
        ({"bapo_lower": 0.7}, "bapo_lower"),  # fixed bounds with the adaptive method
        ({"bapo_target": 1.5}, "target"),
        ({"entropy_coef": 0.01}, "entropy_coef: 0.01 .*entropy_coef=0.0"),
        ({"use_adaptive_entropy": True}, "use_adaptive_entropy: True .*use_adaptive_entropy=False"),
    ],
)
def test_config_refuses_what_bapo_does_not_do(tmp_path, overrides, field_name):
    with pytest.raises(ValueError, match=field_name):
        make_args(tmp_path, **overrides)


def test_refusals_of_trl_surrogates_name_bapos_equivalent(tmp_path):
    with pytest.raises(ValueError, match=r"loss_type: 'sapo' .*bapo_method='sapo'"):
        make_args(tmp_path, loss_type="sapo")
    with pytest.raises(ValueError, match=r"importance_sampling_level: 'sequence' .*bapo_method='gspo'"):
        make_args(tmp_path, importance_sampling_level="sequence")


def test_bapo_bounds_see_the_whole_optimizer_step_and_loss_equals_core(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, bapo_target=0.6, num_iterations=2)
    buffer = generation_buffer(trainer)
    config = trainer.args.bapo_config()
    differs_per_micro_batch = False
    # the two optimizer steps of the second pass over one generation (micro-batches 4-5 and 6-7)
    for first in (STEPS_PER_GENERATION, STEPS_PER_GENERATION + ACCUMULATION):
        start_optimizer_step(trainer, buffer, first)
        step_batches = buffer[first % STEPS_PER_GENERATION : first % STEPS_PER_GENERATION + ACCUMULATION]
        tensors = []
        for batch in step_batches:
            log_prob, entropy = current_log_prob(trainer, batch)
            mask = batch["completion_mask"]
            advantages = batch["advantages"][:, None].expand_as(mask)
            tensors.append((log_prob, entropy, mask, advantages))
        ratios = torch.cat(
            [token_ratio(lp, batch["old_per_token_logps"]) for (lp, *_), batch in zip(tensors, step_batches)]
        )
        assert (ratios - 1).abs().max() > 0.3  # off-policy: the bounds matter
        expected_bounds = search_bounds(
            TokenBatch(
                ratio=ratios, advantages=torch.cat([t[3] for t in tensors]), mask=torch.cat([t[2] for t in tensors])
            ),
            config,
        )
        per_micro_batch = [
            search_bounds(TokenBatch.from_log_probs(lp, batch["old_per_token_logps"], adv, mask), config)
            for (lp, _, mask, adv), batch in zip(tensors, step_batches)
        ]
        # a per-micro-batch search would have used other bounds (checked over both steps below)
        differs_per_micro_batch |= any(
            (found.lower, found.upper) != (expected_bounds.lower, expected_bounds.upper) for found in per_micro_batch
        )
        tokens_per_step = float(buffer[0]["num_items_in_batch"]) * ACCUMULATION / STEPS_PER_GENERATION

        for index, (batch, (log_prob, entropy, mask, advantages)) in enumerate(zip(step_batches, tensors)):
            trainer._step = first + index
            loss = trainer._compute_loss(trainer.model, batch)
            expected, _ = policy_loss(
                log_prob,
                batch["old_per_token_logps"],
                advantages,
                mask,
                "bapo",
                normalizer=tokens_per_step,
                entropy=entropy,
                bounds=(expected_bounds.lower, expected_bounds.upper),
            )
            torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
            assert loss.requires_grad

    assert differs_per_micro_batch
    metrics = trainer._metrics["train"]
    step_tokens = [
        float(sum(b["completion_mask"].sum() for b in buffer[i : i + ACCUMULATION])) for i in (0, ACCUMULATION)
    ]
    assert metrics["bapo/search/tokens"] == step_tokens  # one search per step, over all its micro-batches
    assert metrics["bapo/search/scope"] == [0.0, 0.0]
    assert metrics["bapo/upper"][-1] == expected_bounds.upper
    assert metrics["bapo/lower"][-1] == expected_bounds.lower


def test_search_reuses_trl_old_log_probs_right_after_generation(tiny_model_dir, tmp_path, monkeypatch):
    """At the step TRL generated in, its old log-probs are the current ones: no extra forward."""
    trainer = make_trainer(tiny_model_dir, tmp_path)
    buffer = [micro_batch(trainer, torch.Generator().manual_seed(seed), noise=0.0) for seed in range(4)]
    for batch in buffer:
        batch["num_items_in_batch"] = sum(b["completion_mask"].sum() for b in buffer)
    forwards = []
    original = trainer._completion_log_probs
    monkeypatch.setattr(trainer, "_completion_log_probs", lambda *a, **k: forwards.append(1) or original(*a, **k))
    start_optimizer_step(trainer, buffer, 0)
    for step in range(ACCUMULATION):
        trainer._step = step
        trainer._compute_loss(trainer.model, buffer[step])
    assert len(forwards) == ACCUMULATION  # the losses' own forwards only
    assert trainer._metrics["train"]["bapo/search/steps"] == [0.0]  # ratio 1: nothing to move
    start_optimizer_step(trainer, buffer, ACCUMULATION)  # a later step (weights updated): the search must look
    trainer._compute_loss(trainer.model, buffer[ACCUMULATION])
    assert len(forwards) == ACCUMULATION + ACCUMULATION + 1


def test_micro_batch_scope_solves_each_micro_batch_from_its_own_forward(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path, bapo_target=0.6, num_iterations=2, bapo_scope="micro_batch")
    buffer = generation_buffer(trainer)
    config = trainer.args.bapo_config()
    forwards = []
    original = trainer._completion_log_probs
    monkeypatch.setattr(trainer, "_completion_log_probs", lambda *a, **k: forwards.append(1) or original(*a, **k))
    tokens_per_step = float(buffer[0]["num_items_in_batch"]) * ACCUMULATION / STEPS_PER_GENERATION
    start_optimizer_step(trainer, buffer, STEPS_PER_GENERATION)  # second pass over the generation: stale
    found_all = []
    for index, batch in enumerate(buffer[:ACCUMULATION]):
        trainer._step = STEPS_PER_GENERATION + index
        log_prob, entropy = current_log_prob(trainer, batch)
        mask = batch["completion_mask"]
        advantages = batch["advantages"][:, None].expand_as(mask)
        found = search_bounds(
            TokenBatch.from_log_probs(log_prob, batch["old_per_token_logps"], advantages, mask), config
        )
        found_all.append(found)
        calls = len(forwards)
        loss = trainer._compute_loss(trainer.model, batch)
        assert len(forwards) == calls + 1  # the loss's own forward only
        expected, _ = policy_loss(
            log_prob,
            batch["old_per_token_logps"],
            advantages,
            mask,
            "bapo",
            normalizer=tokens_per_step,
            entropy=entropy,
            bounds=(found.lower, found.upper),
        )
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    metrics = trainer._metrics["train"]
    assert metrics["bapo/search/upper"] == [found.upper for found in found_all]
    assert metrics["bapo/search/lower"] == [found.lower for found in found_all]
    assert metrics["bapo/search/scope"] == [1.0, 1.0]


def test_optimizer_step_boundaries_come_from_trl_state(tiny_model_dir, tmp_path):
    """starts_optimizer_step, read from TRL's counters, is True exactly at the first micro-batch of
    every optimizer step TRL takes (checked on the installed TRL, in a real training run)."""
    seen = []

    class Recording(BAPOGRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append((self.state.global_step, starts_optimizer_step(self)))
            return super()._compute_loss(model, inputs)

    trainer = make_trainer(tiny_model_dir, tmp_path, trainer_class=Recording, max_steps=3, num_iterations=2)
    trainer.train()
    assert [step for step, _ in seen] == [0, 0, 1, 1, 2, 2]
    assert [starts for _, starts in seen] == [True, False] * 3


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_grpo_method_reproduces_trl_loss(tiny_model_dir, tmp_path, loss_type):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, bapo_method="grpo", loss_type=loss_type, epsilon=0.2, epsilon_high=0.28
    )
    buffer = generation_buffer(trainer, seed=1)
    start_optimizer_step(trainer, buffer, 0)
    for step, batch in enumerate(buffer[:ACCUMULATION]):
        trainer._step = step
        ours = trainer._compute_loss(trainer.model, batch)
        trl_loss = GRPOTrainer._compute_loss(trainer, trainer.model, batch)
        torch.testing.assert_close(ours, trl_loss, rtol=1e-5, atol=1e-7)
    assert trainer._metrics["train"]["bapo/clip_frac"][-1] > 0  # the perturbation really clips


def test_vllm_importance_weights_and_kl_match_trl(tiny_model_dir, tmp_path):
    """TRL's vLLM IS ratio multiplies the per-token loss (and enters the BAPO share); beta's KL adds on."""
    trainer = make_trainer(tiny_model_dir, tmp_path, bapo_method="grpo", beta=0.05)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # no vLLM on CPU: feed its ratio by hand
    generator = torch.Generator().manual_seed(2)
    buffer = generation_buffer(trainer, seed=2)
    for batch in buffer:
        batch["importance_sampling_ratio"] = torch.rand(batch["completion_mask"].shape, generator=generator) * 2
        batch["ref_per_token_logps"] = batch["old_per_token_logps"] - 0.1
    start_optimizer_step(trainer, buffer, 0)
    trainer.current_gradient_accumulation_steps = 1  # a step of one micro-batch: its metrics are logged at once
    ours = trainer._compute_loss(trainer.model, buffer[0])
    torch.testing.assert_close(ours, GRPOTrainer._compute_loss(trainer, trainer.model, buffer[0]), rtol=1e-5, atol=1e-7)
    assert "kl" in trainer._metrics["train"]

    bapo = make_trainer(tiny_model_dir, tmp_path, num_iterations=2)
    bapo.use_vllm = bapo.vllm_importance_sampling_correction = True
    start_optimizer_step(bapo, buffer, STEPS_PER_GENERATION)  # second pass: stale
    step = buffer[:ACCUMULATION]
    log_probs = [current_log_prob(bapo, batch)[0] for batch in step]
    ratios = torch.cat([token_ratio(lp, batch["old_per_token_logps"]) for lp, batch in zip(log_probs, step)])
    masks = torch.cat([batch["completion_mask"] for batch in step])
    weighted = torch.cat([batch["advantages"][:, None] * batch["importance_sampling_ratio"] for batch in step])
    expected = search_bounds(TokenBatch(ratio=ratios, advantages=weighted, mask=masks), bapo.args.bapo_config())
    advantages = torch.cat([batch["advantages"][:, None].expand_as(batch["completion_mask"]) for batch in step])
    unweighted = search_bounds(TokenBatch(ratio=ratios, advantages=advantages, mask=masks), bapo.args.bapo_config())
    assert unweighted.upper != expected.upper  # the weights change the answer on this batch
    bapo._compute_loss(bapo.model, step[0])
    assert (bapo.bapo_step.solved.lower, bapo.bapo_step.solved.upper) == (expected.lower, expected.upper)


def test_opsm_and_vllm_weights_reach_the_search_and_the_loss_alike(tiny_model_dir, tmp_path, monkeypatch):
    """With TRL's off_policy_mask_threshold (OPSM) and its vLLM IS ratio, BAPO's search (the step's
    pre-pass) and the loss of every micro-batch get the same per-token weights: the IS ratio times
    bapo.core.off_policy_sequence_mask of the current log-probs against the sampler's."""
    from bapo.core import BAPOStep, off_policy_sequence_mask
    from bapo.integrations.trl import trainer as trainer_module

    bapo = make_trainer(tiny_model_dir, tmp_path, num_iterations=2, off_policy_mask_threshold=0.05)
    bapo.use_vllm = bapo.vllm_importance_sampling_correction = True  # no vLLM on CPU: its ratio by hand
    generator = torch.Generator().manual_seed(4)
    buffer = generation_buffer(bapo, seed=4)
    for batch in buffer:
        batch["importance_sampling_ratio"] = torch.rand(batch["completion_mask"].shape, generator=generator) * 2
        batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + 0.3 * torch.rand(
            batch["completion_mask"].shape, generator=generator
        )
    seen: dict[str, list] = {"observe": [], "loss": []}
    real_observe, real_loss = BAPOStep.observe, trainer_module.policy_loss

    def observe(self, batch, **kwargs):
        seen["observe"].append(batch.importance_weights)
        return real_observe(self, batch, **kwargs)

    def loss(*args, importance_weights=None, **kwargs):
        seen["loss"].append(importance_weights)
        return real_loss(*args, importance_weights=importance_weights, **kwargs)

    monkeypatch.setattr(BAPOStep, "observe", observe)
    monkeypatch.setattr(trainer_module, "policy_loss", loss)
    start_optimizer_step(bapo, buffer, STEPS_PER_GENERATION)  # second pass: stale, a pre-pass runs
    step = buffer[:ACCUMULATION]
    expected = []
    for batch in step:
        log_prob = current_log_prob(bapo, batch)[0]
        mask = batch["completion_mask"]
        keep = off_policy_sequence_mask(log_prob, batch["sampling_per_token_logps"], batch["advantages"], mask, 0.05)
        expected.append(batch["importance_sampling_ratio"] * keep.float())
    for index, batch in enumerate(step):
        bapo._step = STEPS_PER_GENERATION + index
        bapo._compute_loss(bapo.model, batch)
    expected_all = torch.cat(expected)
    assert 0 < float((expected_all.sum(-1) == 0).sum()) < len(expected_all)  # OPSM drops some responses
    masks = torch.cat([batch["completion_mask"] for batch in step]).bool()
    for name, parts in seen.items():
        assert len(parts) == ACCUMULATION, name
        # the loss's forward runs with grad, the reference's without: float32 rounding apart
        got = torch.cat(parts)
        torch.testing.assert_close(got[masks], expected_all[masks], rtol=1e-5, atol=1e-6, msg=name)


def test_training_off_policy_logs_bapo_metrics(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=3, num_iterations=2, bapo_target=0.6)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    config = trainer.args.bapo_config()
    # whole groups per step (the default): a step whose groups all have one reward has no signal,
    # and its shares are missing (NaN, None in TRL's log), never a made-up number
    assert any(entry["bapo/no_signal"] == 0 for entry in logs)
    for entry in logs:
        signal = entry["bapo/no_signal"] == 0
        for key in (
            "bapo/lower",
            "bapo/upper",
            "bapo/positive_share",
            "bapo/clip_frac/upper",
            "bapo/clip_frac/lower",
            "bapo/quadrant/low_pos/loss_share",
            "bapo/ratio/mean",
            "bapo/entropy",
            "bapo/search/reached",
            "bapo/response_length/unrewarded",
            "bapo/positive_share/start_bounds",
        ):
            missing = not signal and key in (
                "bapo/positive_share",
                "bapo/search/reached",
                "bapo/positive_share/start_bounds",
            )
            assert key in entry and (missing or math.isfinite(entry[key])), key
        assert entry["bapo/search/scope"] == 0.0 and (not signal or math.isfinite(entry["bapo/search/share"]))
        assert config.lower_start <= entry["bapo/lower"] <= config.lower_max
        assert config.upper_start <= entry["bapo/upper"] <= config.upper_max
        assert math.isfinite(entry["loss"])
    # After the first update the buffered rollouts are stale: ratios leave 1.
    later = logs[1:]
    assert any(entry["bapo/ratio/max"] > 1 + 1e-4 or entry["bapo/ratio/min"] < 1 - 1e-4 for entry in later)


def step_statistics(search, step_batches, tensors, dual_clip=BAPO_DUAL_CLIP):
    """clip_statistics of one optimizer step's micro-batches concatenated, under the step's bounds
    `search` and the dual-clip cap of method bapo (BAPOGRPOConfig's default, as bapo train's and verl's)."""
    return clip_statistics(
        torch.cat([log_prob for log_prob, *_ in tensors]),
        torch.cat([batch["old_per_token_logps"] for batch in step_batches]),
        torch.cat([advantages for *_, advantages in tensors]),
        torch.cat([mask for _, mask, _ in tensors]),
        search.lower,
        search.upper,
        dual_clip=dual_clip,
    ).finalize()


def test_diagnostics_are_over_the_whole_optimizer_step(tiny_model_dir, tmp_path):
    """One value per optimizer step, over all of its tokens; a micro-batch without signal adds no NaN."""
    trainer = make_trainer(tiny_model_dir, tmp_path, bapo_target=0.6, num_iterations=2)
    buffer = generation_buffer(trainer, seed=4)
    buffer[1]["advantages"] = torch.zeros_like(buffer[1]["advantages"])  # no learning signal
    expected = []
    for first in (STEPS_PER_GENERATION, STEPS_PER_GENERATION + ACCUMULATION):  # stale: ratios differ from 1
        start_optimizer_step(trainer, buffer, first)
        step_batches = buffer[first % STEPS_PER_GENERATION : first % STEPS_PER_GENERATION + ACCUMULATION]
        tensors = []
        for index, batch in enumerate(step_batches):
            mask = batch["completion_mask"]
            tensors.append((current_log_prob(trainer, batch)[0], mask, batch["advantages"][:, None].expand_as(mask)))
            trainer._step = first + index
            trainer._compute_loss(trainer.model, batch)
            # nothing logged before the step's last micro-batch, then one value
            assert len(trainer._metrics["train"]["bapo/positive_share"]) == len(expected) + index
        expected.append(step_statistics(trainer.bapo_step.solved, step_batches, tensors))
    metrics = trainer._metrics["train"]
    assert all(math.isfinite(value) for value in metrics["bapo/positive_share"])
    for name in ("positive_share", "clip_frac", "clip_frac/upper", "clip_frac/lower", "ratio/mean", "tokens"):
        assert metrics[f"bapo/{name}"] == pytest.approx([step[name] for step in expected], rel=1e-5), name
    assert metrics["bapo/tokens"][0] == float(sum(b["completion_mask"].sum() for b in buffer[:ACCUMULATION]))
    assert 0 < metrics["bapo/clip_frac"][0] < 1 or 0 < metrics["bapo/clip_frac"][1] < 1  # something clipped


def test_training_logs_the_share_of_each_optimizer_steps_tokens(tiny_model_dir, tmp_path):
    """A real run whose first micro-batch has no signal: each logged positive_share is finite and
    equals the share over all of that step's tokens (token-weighted, not a mean over micro-batches)."""
    steps: list[list] = []

    class NoSignalFirst(BAPOGRPOTrainer):
        def _compute_loss(self, model, inputs):
            if starts_optimizer_step(self):
                if not steps:
                    inputs = {**inputs, "advantages": torch.zeros_like(inputs["advantages"])}
                steps.append([[], []])
            mask = self._loss_mask(inputs)
            log_prob = current_log_prob(self, inputs)[0]
            batches, tensors = steps[-1][:2]
            batches.append({"old_per_token_logps": self._old_log_prob(inputs, log_prob)})
            tensors.append((log_prob, mask, self._advantages(inputs, mask)))
            loss = super()._compute_loss(model, inputs)
            steps[-1][2:] = [self.bapo_step.solved]  # the step's bounds
            return loss

    # rows: TRL's row shuffle spreads this run's one mixed group over both steps of a generation, so
    # every step has signal once the first micro-batch's is removed (whole groups may leave a step none)
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        trainer_class=NoSignalFirst,
        max_steps=3,
        num_iterations=2,
        bapo_target=0.6,
        bapo_minibatch_split="rows",
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == len(steps) == 3
    assert all(len(tensors) == ACCUMULATION for _, tensors, _ in steps)
    expected = [step_statistics(search, batches, tensors) for batches, tensors, search in steps]
    assert all(math.isfinite(entry["bapo/positive_share"]) for entry in logs)
    for name in ("positive_share", "clip_frac", "tokens"):
        assert [entry[f"bapo/{name}"] for entry in logs] == pytest.approx([step[name] for step in expected], rel=1e-4)


@pytest.mark.parametrize(
    "method, kwargs",
    [
        ("clip-higher", {}),
        ("dual-clip", {"bapo_method_kwargs": '{"dual_clip": 3.0}'}),
        ("topr", {}),
        ("dcpo", {}),
        ("gspo", {}),
        ("m2po", {"bapo_method_kwargs": '{"budget": 0.02}'}),
        ("dppo-tv", {}),
        ("dppo-kl", {"bapo_method_kwargs": '{"ratio_cap": 20.0}'}),
    ],
)
def test_every_core_method_trains(tiny_model_dir, tmp_path, method, kwargs):
    trainer = make_trainer(tiny_model_dir, tmp_path, bapo_method=method, max_steps=1, **kwargs)
    trainer.train()
    entry = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert math.isfinite(entry["loss"]) and "bapo/clip_frac/upper" in entry


def test_decoupled_ppo_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="^bapo_method: 'decoupled-ppo' needs a proximal policy"):
        make_args(tmp_path, bapo_method="decoupled-ppo")


def test_evaluate_searches_on_the_eval_batch(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, per_device_eval_batch_size=GROUP)
    metrics = trainer.evaluate(Dataset.from_list(addition_prompts(2 * GROUP, seed=3)))
    assert math.isfinite(metrics["eval_loss"])
    assert metrics["eval_bapo/search/tokens"] > 0
    assert "eval_bapo/upper" in metrics


EXTRA_TRL = [path for path in os.environ.get("BAPO_EXTRA_TRL_PATHS", "").split(os.pathsep) if path]


@pytest.mark.parametrize(
    "trl_path",
    EXTRA_TRL
    or [
        pytest.param(
            None,
            marks=pytest.mark.skip(
                reason="no other TRL of the pinned range installed; "
                "set BAPO_EXTRA_TRL_PATHS to `pip install --target` dirs"
            ),
        )
    ],
)
def test_optimizer_step_boundaries_on_other_trl_versions(trl_path):
    """The boundary test above against another TRL of the pinned range, installed with
    `pip install --no-deps --target DIR trl==X` (the shared venv keeps its own TRL)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": trl_path, "BAPO_EXTRA_TRL_PATHS": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "boundaries_come_from_trl_state or whole_optimizer_step or micro_batch_scope",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]


def test_group_split_says_when_optimizer_steps_split_groups():
    # (per-device batch, steps_per_generation, gradient accumulation, num_generations, split)
    assert group_split(4, 4, 4, 4, "rows") is None  # one optimizer step per generation batch
    assert "[0, 8]" in group_split(4, 4, 2, 4, "rows")  # TRL's row shuffle, two steps per generation
    assert group_split(4, 4, 2, 4, "groups") is None  # steps start at rows 0 and 8: group boundaries
    assert "multiple of num_generations" in group_split(2, 4, 1, 4, "groups")  # a step starts at row 2
    assert "not whole groups" in group_split(3, 2, 1, 4, "groups")  # 6 rows per process


def step_prompt_counts(trainer) -> list[dict]:
    """Per optimizer step of the last generation batch: how many of its rows each prompt has."""
    counts = []
    for first in range(0, STEPS_PER_GENERATION, ACCUMULATION):
        step: dict = {}
        for batch in trainer._buffered_inputs[first : first + ACCUMULATION]:
            for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"]):
                prompt = tuple(ids[mask.bool()].tolist())
                step[prompt] = step.get(prompt, 0) + 1
        counts.append(step)
    return counts


def test_optimizer_steps_hold_whole_groups_by_default_and_rows_split_them(tiny_model_dir, tmp_path, caplog):
    """steps_per_generation = 2 x gradient_accumulation_steps: each generation batch feeds two
    optimizer steps. By default every prompt of a step has all its GROUP completions in it; with
    TRL's row shuffle some step holds part of a group, and the run says so in one line."""
    for generation in range(3):  # several generations (TRL's global RNG draws each order)
        trainer = make_trainer(tiny_model_dir, tmp_path / f"groups{generation}", max_steps=2, seed=generation)
        trainer.train()
        for step in step_prompt_counts(trainer):
            assert all(count % GROUP == 0 for count in step.values()), step
    assert "hold parts of prompt groups" not in caplog.text
    split_seen = False
    with caplog.at_level("WARNING", logger="bapo.integrations.trl.trainer"):
        for generation in range(3):
            trainer = make_trainer(
                tiny_model_dir,
                tmp_path / f"rows{generation}",
                max_steps=2,
                seed=generation,
                bapo_minibatch_split="rows",
            )
            trainer.train()
            counts = step_prompt_counts(trainer)
            split_seen |= any(count % GROUP for step in counts for count in step.values())
    assert split_seen  # a row shuffle of 16 rows keeps 4 groups of 4 in halves with probability 6/12870
    assert caplog.text.count("steps hold parts of prompt groups") == 3  # one line per run


def test_step_logs_lengths_by_advantage_sign_and_the_share_at_the_start_bounds(tiny_model_dir, tmp_path):
    """TRL's batch has no rewards: response_length/rewarded counts completions with advantage > 0.
    One value per optimizer step over all its micro-batches; the share at BAPO's start bounds is the
    share of the step's ratios at (lower_start, upper_start)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, bapo_target=0.6, num_iterations=2)
    buffer = generation_buffer(trainer, seed=5)
    first = STEPS_PER_GENERATION  # stale: ratios differ from 1
    start_optimizer_step(trainer, buffer, first)
    step_batches = buffer[:ACCUMULATION]
    ratios, advantages, masks = [], [], []
    for index, batch in enumerate(step_batches):
        mask = batch["completion_mask"]
        ratios.append(token_ratio(current_log_prob(trainer, batch)[0], batch["old_per_token_logps"]))
        advantages.append(batch["advantages"])
        masks.append(mask)
        trainer._step = first + index
        trainer._compute_loss(trainer.model, batch)
    lengths, advantage = torch.cat(masks).sum(1).double(), torch.cat(advantages)
    config = trainer.args.bapo_config()
    expected_share = positive_share(
        TokenBatch(ratio=torch.cat(ratios), advantages=advantage, mask=torch.cat(masks)),
        config.lower_start,
        config.upper_start,
        config,
    )
    metrics = trainer._metrics["train"]
    assert metrics["bapo/response_length/rewarded"] == [pytest.approx(float(lengths[advantage > 0].mean()))]
    assert metrics["bapo/response_length/unrewarded"] == [pytest.approx(float(lengths[advantage <= 0].mean()))]
    # the loss's forward vs this test's (same weights and shapes): float32 rounding
    assert metrics["bapo/positive_share/start_bounds"] == [pytest.approx(expected_share, rel=1e-5)]
    assert expected_share != pytest.approx(metrics["bapo/positive_share"][0], rel=1e-3)  # not the used bounds'
