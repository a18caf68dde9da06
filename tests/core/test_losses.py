"""Losses: formulas, gradients per token, aggregation, finiteness on extreme inputs, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.core import BAPOConfig, BoundStats, POLICY_LOSSES, aggregate_loss, group_advantages, policy_loss, token_ratio

ALL_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def per_token_grad(method, log_ratio, advantages, mask=None, **params):
    """Gradient of the token-sum loss w.r.t. each token's log-prob (old log-prob = 0)."""
    log_prob = torch.tensor(log_ratio, dtype=torch.float64).reshape(1, -1).requires_grad_()
    adv = torch.tensor(advantages, dtype=torch.float64).reshape(1, -1)
    mask = torch.ones_like(adv) if mask is None else torch.tensor(mask).reshape(1, -1)
    loss, _ = policy_loss(log_prob, torch.zeros_like(log_prob), adv, mask, method,
                          loss_agg_mode="seq-mean-token-sum", **params)
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
    loss, _ = policy_loss(torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), "dual-clip")
    assert float(loss) == pytest.approx(3.0)


def test_topr_positive_is_sft_like_negative_is_truncated():
    log_ratio = [math.log(4.0), math.log(0.5), math.log(4.0), math.log(0.5)]
    grad = per_token_grad("topr", log_ratio, [2.0, 2.0, -1.0, -1.0])
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


def test_bapo_uses_given_bounds_or_searches_them():
    generator = torch.Generator().manual_seed(3)
    log_prob = (0.4 * torch.randn(4, 10, generator=generator)).requires_grad_()
    old = torch.zeros(4, 10)
    advantages = torch.randn(4, generator=generator)
    mask = torch.ones(4, 10)
    cfg = BAPOConfig(target=0.5)
    _, searched = policy_loss(log_prob, old, advantages, mask, "bapo", bapo=cfg)
    found = BoundStats(cfg).add(token_ratio(log_prob, old), advantages, mask).solve(sync=False)
    assert (searched["lower"], searched["upper"]) == (found.lower, found.upper)
    given_loss, given = policy_loss(log_prob, old, advantages, mask, "bapo", bounds=(0.7, 2.0))
    grpo_loss, _ = policy_loss(log_prob, old, advantages, mask, "grpo", lower=0.7, upper=2.0)
    assert (given["lower"], given["upper"]) == (0.7, 2.0) and float(given_loss.detach()) == pytest.approx(float(grpo_loss.detach()))


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
        halves = sum(aggregate_loss(token_loss[i:i + 1], mask[i:i + 1], mode, normalizer) for i in range(2))
        assert float(halves) == pytest.approx(float(whole))


def test_importance_weights_multiply_the_token_loss():
    log_prob = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = policy_loss(log_prob, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), "grpo",
                          importance_weights=weights, loss_agg_mode="seq-mean-token-sum")
    loss.backward()
    assert log_prob.grad.tolist() == [[-0.5, -2.0]]


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
    rewards = {"zero": torch.zeros(batch), "negative": -torch.ones(batch), "mixed": torch.tensor([1.0, 0.0, 0.0, 1.0]),
               "zero-variance-groups": torch.tensor([1.0, 1.0, 0.0, 0.0])}[advantage_kind]
    advantages, _ = group_advantages(rewards, 2)
    if advantage_kind == "negative":
        advantages = -torch.ones(batch)  # all-negative group, as a Dr.GRPO-free caller may pass
    mask = {"empty": torch.zeros(batch, length), "full": torch.ones(batch, length),
            "random": (torch.rand(batch, length, generator=generator) > 0.5).float()}[mask_kind]
    loss, metrics = policy_loss(log_prob, old.to(dtype), advantages.to(dtype), mask, method, loss_agg_mode=mode)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    assert all(math.isfinite(v) for k, v in metrics.items() if k != "upper")


def test_zero_variance_groups_get_exactly_zero_advantage():
    advantages, zero_variance = group_advantages(torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 0.5]), 3)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0] and zero_variance.tolist() == [True] * 3 + [False] * 3
    assert advantages[3:].sum().item() == pytest.approx(0.0, abs=1e-6)
    unscaled, _ = group_advantages(torch.tensor([1.0, 0.0]), 2, scale_by_std=False)
    assert unscaled.tolist() == [0.5, -0.5]


@pytest.mark.parametrize("kwargs, name", [
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
])
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3), advantages=torch.zeros(2),
                mask=torch.ones(2, 3), method="grpo")
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        policy_loss(**args)


def test_bapo_search_inside_the_loss_weighs_tokens_by_importance_weights():
    generator = torch.Generator().manual_seed(5)
    log_prob = 0.5 * torch.randn(4, 12, generator=generator)
    advantages = torch.randn(4, generator=generator)
    mask = torch.ones(4, 12)
    weights = torch.rand(4, 12, generator=generator) * 2
    cfg = BAPOConfig(target=0.5, lower_step=0.05)
    _, metrics = policy_loss(log_prob, torch.zeros(4, 12), advantages, mask, "bapo", bapo=cfg, importance_weights=weights)
    found = BoundStats(cfg).add(token_ratio(log_prob, torch.zeros(4, 12)), advantages, mask, weights=weights).solve(sync=False)
    assert (metrics["lower"], metrics["upper"]) == (found.lower, found.upper)
