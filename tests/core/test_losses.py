"""Losses: formulas, gradients per token, aggregation, finiteness on extreme inputs, bad input."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.core import (
    POLICY_LOSSES,
    PROXIMAL_METHODS,
    BAPOConfig,
    BAPOStep,
    BoundStats,
    PromptRewardHistory,
    TokenBatch,
    aggregate_loss,
    group_advantages,
    policy_loss,
    smooth_advantages,
    token_ratio,
)

ALL_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def per_token_grad(method, log_ratio, advantages, mask=None, **params):
    """Gradient of the token-sum loss w.r.t. each token's log-prob (old log-prob = 0)."""
    log_prob = torch.tensor(log_ratio, dtype=torch.float64).reshape(1, -1).requires_grad_()
    adv = torch.tensor(advantages, dtype=torch.float64).reshape(1, -1)
    mask = torch.ones_like(adv) if mask is None else torch.tensor(mask).reshape(1, -1)
    loss, _ = policy_loss(
        log_prob, torch.zeros_like(log_prob), adv, mask, method, loss_agg_mode="seq-mean-token-sum", **params
    )
    loss.backward()
    return log_prob.grad[0]


def test_grpo_is_the_ppo_surrogate_and_clips_the_right_tokens():
    # ratios 1.5 (A>0: clipped), 1.1 (A>0: free), 0.5 (A<0: clipped), 0.9 (A<0: free), 1.5 (A<0: free, r*A is smaller)
    log_ratio = [math.log(r) for r in (1.5, 1.1, 0.5, 0.9, 1.5)]
    advantages = [1.0, 1.0, -1.0, -1.0, -1.0]
    grad = per_token_grad("grpo", log_ratio, advantages)
    expected = [0.0, -1.1, 0.0, 0.9, 1.5]  # d(-r*A)/dlog r = -r*A where unclipped
    assert grad.tolist() == pytest.approx(expected)
    ratio = torch.tensor([[1.5, 1.1, 0.5, 0.9, 1.5]], dtype=torch.float64)
    adv = torch.tensor([advantages], dtype=torch.float64)
    manual = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    loss, metrics = policy_loss(ratio.log(), torch.zeros_like(ratio), adv, torch.ones_like(ratio), "grpo")
    assert float(loss) == pytest.approx(float(manual))
    assert metrics["clip_frac/upper"] == pytest.approx(0.5) and metrics["clip_frac/lower"] == pytest.approx(1 / 3)
    assert (metrics["lower"], metrics["upper"]) == (0.8, 1.2)


def test_clip_higher_keeps_moderately_stale_positive_tokens():
    log_ratio, advantages = [math.log(1.25)], [1.0]
    assert per_token_grad("grpo", log_ratio, advantages).item() == 0.0
    assert per_token_grad("clip-higher", log_ratio, advantages).item() == pytest.approx(-1.25)


def test_dual_clip_caps_negative_tokens_with_huge_ratio():
    grad = per_token_grad("dual-clip", [math.log(5.0), math.log(2.0)], [-1.0, -1.0])
    assert grad.tolist() == pytest.approx([0.0, 2.0])  # r=5 > 3: capped, no gradient
    loss, _ = policy_loss(
        torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), "dual-clip"
    )
    assert float(loss) == pytest.approx(3.0)


def test_topr_token_level_positive_is_sft_like_negative_is_truncated():
    log_ratio = [math.log(4.0), math.log(0.5), math.log(4.0), math.log(0.5)]
    grad = per_token_grad("topr", log_ratio, [2.0, 2.0, -1.0, -1.0], level="token")
    # positive: -A (no ratio); negative: -A * min(r, 1)
    assert grad.tolist() == pytest.approx([-2.0, -2.0, 1.0, 0.5])


def test_dcpo_bounds_widen_for_low_prior_probability():
    high_prior = torch.log(torch.tensor([[1.0]]))
    low_prior = torch.log(torch.tensor([[0.05]]))
    for prior, expected_upper in ((high_prior, 0.5 + 0.5 * math.sqrt(1.8)), (low_prior, 0.5 + 0.5 * math.sqrt(1 + 16))):
        _, metrics = policy_loss(prior.clone(), prior, torch.ones(1, 1), torch.ones(1, 1), "dcpo")
        assert metrics["upper"] == pytest.approx(expected_upper, rel=1e-5)
    _, metrics = policy_loss(high_prior.clone(), high_prior, torch.ones(1, 1), torch.ones(1, 1), "dcpo")
    assert metrics["lower"] == pytest.approx(0.8, rel=1e-5)
    # With q = 1 (old log-prob 0) ratios 2 and 3 are both clipped, as under PPO; with q = 0.05 the
    # upper bound is ~2.56: ratio 2 now carries gradient, ratio 3 still does not.
    assert per_token_grad("dcpo", [math.log(2.0), math.log(3.0)], [1.0, 1.0]).tolist() == [0.0, 0.0]
    prior = low_prior.item()
    log_prob = torch.tensor([[prior + math.log(2.0), prior + math.log(3.0)]], requires_grad=True)
    loss, _ = policy_loss(log_prob, torch.full((1, 2), prior), torch.ones(1, 2), torch.ones(1, 2), "dcpo")
    loss.backward()
    assert log_prob.grad[0, 0] != 0 and log_prob.grad[0, 1] == 0


def test_bapo_uses_given_bounds_and_refuses_to_run_without_them():
    generator = torch.Generator().manual_seed(3)
    log_prob = (0.4 * torch.randn(4, 10, generator=generator)).requires_grad_()
    old = torch.zeros(4, 10)
    advantages = torch.randn(4, generator=generator)
    mask = torch.ones(4, 10)
    cfg = BAPOConfig(target=0.5)
    found = BoundStats(cfg).add(TokenBatch(ratio=token_ratio(log_prob, old), advantages=advantages, mask=mask))
    found = found.solve(sync=False)
    _, searched = policy_loss(log_prob, old, advantages, mask, "bapo", bounds=found)  # a SearchResult serves
    assert (searched["lower"], searched["upper"]) == (found.lower, found.upper)
    with pytest.raises(ValueError, match="^bounds: .*BAPOStep"):  # the loss does no search of its own
        policy_loss(log_prob, old, advantages, mask, "bapo")
    given_loss, given = policy_loss(log_prob, old, advantages, mask, "bapo", bounds=(0.7, 2.0))
    grpo_loss, _ = policy_loss(log_prob, old, advantages, mask, "grpo", lower=0.7, upper=2.0)
    assert (given["lower"], given["upper"]) == (0.7, 2.0) and float(given_loss.detach()) == pytest.approx(
        float(grpo_loss.detach())
    )


def test_aggregation_modes_and_micro_batch_normalizer():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(aggregate_loss(token_loss, mask, "token-mean")) == pytest.approx(7 / 3)
    assert float(aggregate_loss(token_loss, mask, "seq-mean-token-sum")) == pytest.approx((3 + 4) / 2)
    assert float(aggregate_loss(token_loss, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2)
    assert float(aggregate_loss(token_loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(7 / 6)
    for mode in ALL_MODES:
        whole = aggregate_loss(token_loss, mask, mode)
        normalizer = {"token-mean": 3.0, "seq-mean-token-sum-norm": 6.0}.get(mode, 2.0)
        halves = sum(aggregate_loss(token_loss[i : i + 1], mask[i : i + 1], mode, normalizer) for i in range(2))
        assert float(halves) == pytest.approx(float(whole))


def test_importance_weights_multiply_the_token_loss():
    log_prob = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = policy_loss(
        log_prob,
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.ones(1, 2),
        "grpo",
        importance_weights=weights,
        loss_agg_mode="seq-mean-token-sum",
    )
    loss.backward()
    assert log_prob.grad.tolist() == [[-0.5, -2.0]]


def required_params(method: str, log_prob, old_log_prob, advantages, mask) -> dict:
    """What a generic call of `method` must pass besides the tensors: BAPO's bounds, searched on
    this batch alone by BAPOStep (the loss does no search of its own); a proximal policy halfway
    between behaviour and current for decoupled PPO; {} for the other losses."""
    if method in PROXIMAL_METHODS:
        return {"proximal_log_prob": (log_prob.detach().float() + old_log_prob.float()) / 2}
    if method != "bapo":
        return {}
    counted = mask.to(torch.bool)
    ratio = token_ratio(
        torch.where(counted, log_prob.detach().float(), 0.0), torch.where(counted, old_log_prob.float(), 0.0)
    )
    step = BAPOStep(BAPOConfig(scope="micro_batch"))
    step.begin()
    return {"bounds": step.bounds_for(TokenBatch(ratio=ratio, advantages=advantages.float(), mask=mask))}


@settings(max_examples=60, deadline=None)
@given(
    method=st.sampled_from(sorted(POLICY_LOSSES)),
    mode=st.sampled_from(ALL_MODES),
    gap=st.sampled_from([1e4, -1e4, 50.0, -50.0, 0.0]),
    advantage_kind=st.sampled_from(["zero", "negative", "mixed", "zero-variance-groups"]),
    mask_kind=st.sampled_from(["empty", "full", "random"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_every_loss_is_finite_on_extreme_inputs(method, mode, gap, advantage_kind, mask_kind, dtype):
    generator = torch.Generator().manual_seed(0)
    batch, length = 4, 5
    old = torch.randn(batch, length, generator=generator) - 2.0
    log_prob = (old + gap * torch.rand(batch, length, generator=generator)).to(dtype).requires_grad_()
    rewards = {
        "zero": torch.zeros(batch),
        "negative": -torch.ones(batch),
        "mixed": torch.tensor([1.0, 0.0, 0.0, 1.0]),
        "zero-variance-groups": torch.tensor([1.0, 1.0, 0.0, 0.0]),
    }[advantage_kind]
    advantages, _ = group_advantages(rewards, 2)
    if advantage_kind == "negative":
        advantages = -torch.ones(batch)  # all-negative group, as a Dr.GRPO-free caller may pass
    mask = {
        "empty": torch.zeros(batch, length),
        "full": torch.ones(batch, length),
        "random": (torch.rand(batch, length, generator=generator) > 0.5).float(),
    }[mask_kind]
    params = required_params(method, log_prob, old.to(dtype), advantages.to(dtype), mask)
    loss, metrics = policy_loss(
        log_prob, old.to(dtype), advantages.to(dtype), mask, method, loss_agg_mode=mode, **params
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    # positive_share is NaN exactly when no token carries signal (counted in bapo/no_signal)
    premise = {k: v for k, v in metrics.items() if k.startswith("premise/")}
    assert all(math.isfinite(v) for k, v in metrics.items() if k not in ("upper", "positive_share", *premise))
    # a premise share is a share in [0, 1], or NaN when its group is empty (always, with no token of that sign)
    assert all(math.isnan(v) or 0.0 <= v <= 1.0 for v in premise.values())
    token_advantages = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    for sign, tokens in (("pos", token_advantages > 0), ("neg", token_advantages < 0)):
        if not (tokens & mask.bool()).any():
            assert math.isnan(premise[f"premise/{sign}_clipped_low_share"])
            assert math.isnan(premise[f"premise/{sign}_kept_low_share"])
    assert math.isfinite(metrics["positive_share"]) or metrics["bapo/no_signal"] == 1.0 or metrics["clip_frac"] > 0


def test_zero_variance_groups_get_exactly_zero_advantage():
    advantages, zero_variance = group_advantages(torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 0.5]), 3)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0] and zero_variance.tolist() == [True] * 3 + [False] * 3
    assert advantages[3:].sum().item() == pytest.approx(0.0, abs=1e-6)
    unscaled, _ = group_advantages(torch.tensor([1.0, 0.0]), 2, scale_by_std=False)
    assert unscaled.tolist() == [0.5, -0.5]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(old_log_prob=torch.zeros(2, 4)), "old_log_prob"),
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(mask=torch.full((2, 3), 2.0)), "mask"),
        (dict(log_prob=torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]])), "log_prob"),
        (dict(log_prob=torch.zeros(2, 3, dtype=torch.long)), "log_prob"),
        (dict(method="gpro"), "did you mean 'grpo'"),
        (dict(lower=1.2), "lower"),
        (dict(upper=0.95), "upper"),
        (dict(upper_bound=1.3), "upper_bound"),
        (dict(loss_agg_mode="mean"), "loss_agg_mode"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(
        log_prob=torch.zeros(2, 3),
        old_log_prob=torch.zeros(2, 3),
        advantages=torch.zeros(2),
        mask=torch.ones(2, 3),
        method="grpo",
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        policy_loss(**args)


def test_bapo_micro_batch_bounds_weigh_tokens_by_importance_weights():
    generator = torch.Generator().manual_seed(5)
    log_prob = 0.5 * torch.randn(4, 12, generator=generator)
    advantages = torch.randn(4, generator=generator)
    mask = torch.ones(4, 12)
    weights = torch.rand(4, 12, generator=generator) * 2
    cfg = BAPOConfig(target=0.5, lower_step=0.05, scope="micro_batch")
    step = BAPOStep(cfg)
    step.begin()
    batch = TokenBatch(
        ratio=token_ratio(log_prob, torch.zeros(4, 12)), advantages=advantages, mask=mask, importance_weights=weights
    )
    searched = step.bounds_for(batch)
    _, metrics = policy_loss(
        log_prob, torch.zeros(4, 12), advantages, mask, "bapo", bounds=searched, importance_weights=weights
    )
    found = BoundStats(cfg).add(batch).solve(sync=False)
    unweighted = BoundStats(cfg).add(dataclasses.replace(batch, importance_weights=None)).solve(sync=False)
    assert (metrics["lower"], metrics["upper"]) == (found.lower, found.upper)
    assert searched.positive_share == found.positive_share != unweighted.positive_share


# --- numerics: fp16 inputs, inf inputs, masked -inf, normalizer --------------------------------


FLOAT16_MAX = torch.finfo(torch.float16).max
DUAL_CLIP_LOSSES = ("grpo", "clip-higher", "bapo", "dcpo")
# |gradient| <= c * |A| whatever the ratio: TOPR (weight <= 1), dual-clip, CISPO (weight <= upper), SAPO (the gate)
BOUNDED_GRADIENT_LOSSES = ("topr", "dual-clip", "cispo", "cispo-verl", "sapo")


@settings(max_examples=200, deadline=None)
@given(
    method=st.sampled_from(sorted(POLICY_LOSSES)),
    dual_clip=st.sampled_from([None, 3.0]),
    mode=st.sampled_from(ALL_MODES),
    log_gap=st.floats(-30.0, 30.0),
    spread=st.floats(0.0, 15.0),
    advantage_scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_fp16_inputs_give_finite_losses_and_gradients(method, dual_clip, mode, log_gap, spread, advantage_scale, seed):
    """fp16 log-probs (behaviour log-probs down to -25, log-ratios up to ~+-45; exp(11.1) is inf in
    float16): the loss is always finite and float32. The gradient w.r.t. an fp16 log-prob is fp16:
    it is finite and equals the float64 gradient whenever that fits float16, always with dual-clip
    (bounded by 3|A|). Without dual-clip a negative token's exact gradient r*|A| can exceed 65504;
    then no fp16 tensor can hold it, which is what dual-clip (the trainer's and verl's default) is for."""
    params = {"dual_clip": dual_clip} if method in DUAL_CLIP_LOSSES and dual_clip is not None else {}
    if method == "bapo":
        params["bounds"] = (0.8, 1.2)
    generator = torch.Generator().manual_seed(seed)
    old = (-25.0 * torch.rand(3, 6, generator=generator)).half()
    log_prob = (old.float() + log_gap + spread * torch.randn(3, 6, generator=generator)).clamp(max=0.0).half()
    if method in PROXIMAL_METHODS:
        params["proximal_log_prob"] = ((old.float() + log_prob.float()) / 2).half()
    advantages = (advantage_scale * torch.randn(3, generator=generator)).half()
    mask = (torch.rand(3, 6, generator=generator) > 0.3).float()
    gradients = []
    for dtype in (torch.float16, torch.float64):
        leaf = log_prob.detach().to(dtype).clone().requires_grad_()
        torch.manual_seed(seed)  # clip-cov draws with torch's global generator: the same draw in both runs
        loss, metrics = policy_loss(
            leaf, old.to(dtype), advantages.to(dtype), mask, method, loss_agg_mode=mode, **params
        )
        loss.backward()
        assert torch.isfinite(loss) and math.isfinite(metrics["ratio/max"])
        gradients.append(leaf.grad)
    assert loss.dtype == torch.float64 and math.isfinite(metrics["entropy_change_estimate"])
    half_grad, exact_grad = gradients
    if exact_grad.abs().max() < 0.99 * FLOAT16_MAX:
        assert torch.isfinite(half_grad).all()
        torch.testing.assert_close(
            half_grad.double(), exact_grad, rtol=2e-3, atol=1e-3 * float(exact_grad.abs().max()) + 1e-6
        )
    bounded = method in BOUNDED_GRADIENT_LOSSES or (method in DUAL_CLIP_LOSSES and dual_clip is not None)
    assert not bounded or torch.isfinite(half_grad).all()


def test_fp16_loss_is_float32():
    log_prob = torch.tensor([[-20.0, -0.1]], dtype=torch.float16, requires_grad=True)
    old = torch.tensor([[-0.1, -19.0]], dtype=torch.float16)  # log-ratios -19.9 and +18.9: exp overflows fp16
    loss, metrics = policy_loss(log_prob, old, torch.tensor([1.0]).half(), torch.ones(1, 2), "dual-clip")
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    assert metrics["ratio/max"] == pytest.approx(math.exp(18.9), rel=1e-2)


@pytest.mark.parametrize("name", ["log_prob", "old_log_prob", "advantages", "importance_weights"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_inf_under_the_mask_is_rejected_naming_the_argument(name, value):
    args = dict(
        log_prob=torch.zeros(2, 3),
        old_log_prob=torch.zeros(2, 3),
        advantages=torch.ones(2, 3),
        importance_weights=torch.ones(2, 3),
    )
    args[name] = args[name].clone()
    args[name][1, 1] = value
    with pytest.raises(ValueError, match=f"^{name}: .*inf"):
        policy_loss(mask=torch.ones(2, 3), method="grpo", **args)


@pytest.mark.parametrize("method", sorted(POLICY_LOSSES))
def test_minus_inf_log_probs_on_masked_positions_give_no_nan(method):
    """Padding log-probs of -inf (a masked logit) are never read: finite loss, zero gradient there."""
    log_prob = torch.tensor([[-0.5, -1.0, float("-inf")], [-2.0, float("-inf"), float("-inf")]], requires_grad=True)
    old = torch.tensor([[-0.7, -0.9, float("-inf")], [-1.5, float("-inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages = torch.tensor([1.0, -1.0])
    params = required_params(method, log_prob, old, advantages, mask)
    loss, metrics = policy_loss(log_prob, old, advantages, mask, method, **params)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    assert log_prob.grad[0, 2] == 0 and log_prob.grad[1, 1:].abs().sum() == 0
    assert math.isfinite(metrics["entropy_change_estimate"]) and math.isfinite(metrics["approx_kl"])


@pytest.mark.parametrize("normalizer", [0.0, -3.0, float("nan"), float("inf"), torch.tensor(0.0)])
def test_normalizer_must_be_positive(normalizer):
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), "grpo", normalizer=normalizer
        )


# --- dual-clip ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["grpo", "clip-higher", "bapo", "dcpo"])
def test_dual_clip_bounds_a_ratio_500_negative_token(method):
    """A stale negative token with ratio 500: without dual-clip its loss is 500*|A| with gradient
    500*|A|; with dual_clip=3 the loss is 3*|A| and it sends no gradient."""
    log_prob = torch.tensor([[math.log(500.0), math.log(1.1)]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[-2.0, 1.0]], dtype=torch.float64)
    params = {"bounds": (0.8, 1.2)} if method == "bapo" else {}
    old = torch.zeros(1, 2, dtype=torch.float64)  # q = 1: DCPO's bounds are (0.8, 1.17), 1.1 is free everywhere
    loss, metrics = policy_loss(
        log_prob, old, advantages, torch.ones(1, 2), method, loss_agg_mode="seq-mean-token-sum", dual_clip=3.0, **params
    )
    loss.backward()
    assert log_prob.grad[0, 0] == 0.0
    assert float(loss.detach()) == pytest.approx(3.0 * 2.0 - 1.1)  # capped at 3 * |A|, plus the free token
    assert metrics["clip_frac/dual"] == 1.0 and metrics["clip_frac"] == 0.5
    free_log_prob = log_prob.detach().clone().requires_grad_()
    free, free_metrics = policy_loss(
        free_log_prob, old, advantages, torch.ones(1, 2), method, loss_agg_mode="seq-mean-token-sum", **params
    )
    free.backward()
    assert free_log_prob.grad[0, 0] == pytest.approx(1000.0) and free_metrics["clip_frac/dual"] == 0.0


def test_dual_clip_is_off_in_core_defaults_and_on_in_the_named_baseline():
    log_prob, advantages = torch.tensor([[math.log(5.0)]]), -torch.ones(1, 1)
    grpo, _ = policy_loss(log_prob, torch.zeros(1, 1), advantages, torch.ones(1, 1), "grpo")
    named, _ = policy_loss(log_prob, torch.zeros(1, 1), advantages, torch.ones(1, 1), "dual-clip")
    assert float(grpo) == pytest.approx(5.0) and float(named) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(log_prob, torch.zeros(1, 1), advantages, torch.ones(1, 1), "bapo", dual_clip=0.9)


# --- TOPR at sequence level, DCPO complete: worked examples from the papers' formulas ------------


def test_topr_sequence_level_weights_negative_sequences_by_their_truncated_sequence_ratio():
    """TOPR: grad = sum_{A>=0} A grad log pi(y) + sum_{A<0} sg(min(prod_t r_t, 1)) A grad log pi(y),
    averaged over sequences (seq-mean-token-sum, the default)."""
    ratios = torch.tensor([[2.0, 0.5], [2.0, 0.25], [2.0, 1.0], [3.0, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    log_prob = ratios.log().requires_grad_()
    loss, _ = policy_loss(log_prob, torch.zeros_like(ratios), advantages, torch.ones_like(ratios), "topr")
    loss.backward()
    # sequence weights: A>=0 -> 1; prod r = 0.5 -> 0.5; prod r = 2 -> min(2, 1) = 1; A = 0 -> no gradient.
    # d loss / d log pi(y_t) = -A * weight / 4 sequences, the same for every token of the sequence.
    expected = [-0.25, -0.25, 0.125, 0.125, 0.25, 0.25, 0.0, 0.0]
    assert log_prob.grad.flatten().tolist() == pytest.approx(expected)
    assert float(loss.detach()) == pytest.approx((-1 * 2 + 0.5 * 2 + 1 * 2) / 4)
    token, _ = policy_loss(
        ratios.log(), torch.zeros_like(ratios), advantages, torch.ones_like(ratios), "topr", level="token"
    )
    assert float(token.detach()) != pytest.approx(float(loss.detach()))  # per token: min(r_t, 1) differs


def test_topr_sequence_ratio_ignores_masked_tokens_and_survives_long_stale_sequences():
    log_prob = torch.tensor([[math.log(0.5), 50.0, 80.0]], requires_grad=True)
    loss, _ = policy_loss(log_prob, torch.zeros(1, 3), -torch.ones(1), torch.tensor([[1, 0, 0]]), "topr")
    loss.backward()
    assert log_prob.grad.flatten().tolist() == pytest.approx([0.5, 0.0, 0.0])
    long = torch.full((1, 200), 5.0, requires_grad=True)  # prod r = exp(1000): truncated to 1, finite
    loss, _ = policy_loss(long, torch.zeros(1, 200), -torch.ones(1), torch.ones(1, 200), "topr")
    loss.backward()
    assert torch.isfinite(long.grad).all() and long.grad[0, 0] == pytest.approx(1.0)


def test_dcpo_worked_example_bounds_dual_clip_and_aggregation():
    """DCPO per token from q = pi_behaviour: upper = 0.5 + 0.5 sqrt(1 + 4*0.2/q), lower =
    0.5 + 0.5 sqrt(max(1 - 4*0.16/q, 0)); token sums per response averaged over responses."""
    q = torch.tensor([[1.0, 0.05], [0.5, 0.8]], dtype=torch.float64)
    ratios = torch.tensor([[1.1, 2.0], [0.5, 5.0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    log_prob = (q.log() + ratios.log()).requires_grad_()
    loss, metrics = policy_loss(log_prob, q.log(), advantages, torch.ones_like(q), "dcpo", dual_clip=3.0)
    loss.backward()
    upper_00 = 0.5 + 0.5 * math.sqrt(1 + 0.8)  # 1.1708: r = 1.1 free
    upper_01 = 0.5 + 0.5 * math.sqrt(1 + 0.8 / 0.05)  # 2.5616: r = 2.0 free
    lower_10 = 0.5 + 0.5 * math.sqrt(max(1 - 0.64 / 0.5, 0))  # 0.5: r = 0.5 sits on the bound, free
    assert upper_00 > 1.1 and upper_01 > 2.0 and lower_10 == 0.5
    # token losses: -1.1, -2.0 (A = +1); 0.5 (A = -1, r*|A|); r = 5 > 3: dual-clipped at 3*|A| = 3
    assert float(loss.detach()) == pytest.approx(((-1.1 - 2.0) + (0.5 + 3.0)) / 2)
    assert log_prob.grad.flatten().tolist() == pytest.approx([-1.1 / 2, -2.0 / 2, 0.5 / 2, 0.0])
    assert metrics["clip_frac/dual"] == 0.5


def test_smooth_advantages_worked_example():
    """SAS with one prompt of four responses, history over two earlier steps (mean 0.5, std 0.5)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    advantages, mean, std, steps = smooth_advantages(
        rewards, 4, torch.tensor([0.5]), torch.tensor([0.5]), torch.tensor([2])
    )
    step_mean, step_std = 0.25, 0.5  # std unbiased: sqrt((0.5625 + 3*0.0625)/3)
    i = 3
    total_mean = (0.5 * 2 + step_mean) / i  # 0.41667
    total_std = math.sqrt((2 * 0.25 + step_std**2 + 2 / 3 * (step_mean - 0.5) ** 2) / i)  # 0.51370
    assert (float(mean[0]), float(std[0]), int(steps[0])) == (pytest.approx(total_mean), pytest.approx(total_std), 3)
    expected = []
    for reward in (1.0, 0.0):
        new, total = (reward - step_mean) / step_std, (reward - total_mean) / total_std
        first, second = total / i + new * (1 - 1 / i), new / i + total * (1 - 1 / i)
        expected.append(first if abs(first) < abs(second) else second)
    assert advantages.tolist() == pytest.approx([expected[0]] + [expected[1]] * 3)
    assert advantages[0] == pytest.approx(1.257033, abs=1e-5) and advantages[1] == pytest.approx(-0.603702, abs=1e-5)


def test_smooth_advantages_first_step_is_grpo_and_history_rescues_zero_variance_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    first, mean, std, steps = smooth_advantages(
        rewards, 3, torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.long)
    )
    grouped = rewards.reshape(2, 3)
    grpo = ((grouped[0] - grouped[0].mean()) / grouped[0].std()).tolist()
    assert first[:3].tolist() == pytest.approx(grpo) and first[3:].tolist() == [0.0, 0.0, 0.0]
    assert steps.tolist() == [1, 1] and std[1] == 0
    # the all-correct prompt again, now with history mean 1, std 0 -> still 0; a prompt whose history
    # had failures gets a positive advantage for an all-correct group
    again, *_ = smooth_advantages(torch.ones(3), 3, torch.tensor([0.5]), torch.tensor([0.5]), torch.tensor([1]))
    assert (again > 0).all()
    with pytest.raises(ValueError, match="history_steps"):
        smooth_advantages(torch.ones(3), 3, torch.zeros(1), torch.zeros(1), torch.zeros(2))


def test_prompt_reward_history_chains_smooth_advantages_per_prompt_and_round_trips():
    history = PromptRewardHistory()
    first = history.advantages(["a", "b"], torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), 3)
    direct, mean, std, steps = smooth_advantages(
        torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]),
        3,
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2, dtype=torch.long),
    )
    assert first.tolist() == pytest.approx(direct.tolist())
    restored = PromptRewardHistory()
    restored.load_state_dict(history.state_dict())
    # step 2: prompt "b" again (history: mean 1/3, steps 1) and a new prompt "c"
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    second = history.advantages(["b", "c"], rewards, 3)
    expected, *_ = smooth_advantages(
        rewards, 3, torch.tensor([float(mean[1]), 0.0]), torch.tensor([float(std[1]), 0.0]), torch.tensor([1, 0])
    )
    assert second.tolist() == pytest.approx(expected.tolist())
    assert (second[:3] < 0).all() or (second[:3] > 0).all()  # an all-correct group now carries signal
    assert restored.advantages(["b", "c"], rewards, 3).tolist() == pytest.approx(second.tolist())
    assert history.stats["b"][2] == 2 and history.stats["a"][2] == 1
    with pytest.raises(ValueError, match="prompt_keys"):
        history.advantages(["a"], rewards, 3)
