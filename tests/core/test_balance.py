"""bapo.core.balance_sums / balance_metrics: response lengths of rewarded vs unrewarded responses and
the positive share at BAPO's start bounds, on hand-made batches with known answers."""

import math

import pytest
import torch

from bapo.core import BAPOConfig, TokenBatch, balance_metrics, balance_sums, group_advantages, positive_share


def lengths_mask(lengths: list[int], width: int = 8) -> torch.Tensor:
    return torch.arange(width) < torch.tensor(lengths)[:, None]


def test_lengths_split_by_reward_and_share_at_ratio_one_is_lc_over_lc_plus_lw():
    # one group of 5: two correct replies of 2 and 4 tokens (Lc = 3), three wrong of 5, 6, 7 (Lw = 6)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0])
    advantages, _ = group_advantages(rewards, 5)
    mask = lengths_mask([2, 4, 5, 6, 7])
    metrics = balance_metrics(balance_sums(TokenBatch.fresh(advantages, mask), rewards > 0, BAPOConfig()))
    assert metrics["response_length/rewarded"] == pytest.approx(3.0)
    assert metrics["response_length/unrewarded"] == pytest.approx(6.0)
    # the accuracy cancels: a group's advantages sum to 0, so at ratio 1 the share is Lc / (Lc + Lw)
    # (float32 advantages: agreement to float32 rounding)
    assert metrics["positive_share/start_bounds"] == pytest.approx(3.0 / (3.0 + 6.0), rel=1e-6)


def test_share_is_at_the_start_bounds_and_sums_add_over_micro_batches():
    generator = torch.Generator().manual_seed(0)
    ratio = torch.exp(0.5 * torch.randn(6, 8, generator=generator))  # many ratios outside [0.7, 1.3]
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2, 0.0, 0.3])
    mask = lengths_mask([8, 3, 5, 1, 6, 0])  # an empty response counts with length 0
    config = BAPOConfig(lower_start=0.7, upper_start=1.3, lower_max=0.9)
    batch = TokenBatch(ratio=ratio, advantages=advantages, mask=mask)
    whole = balance_sums(batch, advantages > 0, config)
    halves = sum(
        balance_sums(
            TokenBatch(ratio=ratio[rows], advantages=advantages[rows], mask=mask[rows]), advantages[rows] > 0, config
        )
        for rows in (slice(0, 2), slice(2, 6))
    )
    # float64 sums of float32 terms in a different order: equal to float64 rounding of ~10 terms
    assert torch.allclose(whole, halves, rtol=1e-12, atol=0)
    metrics = balance_metrics(whole)
    assert metrics["response_length/rewarded"] == pytest.approx((8 + 5 + 0) / 3)  # rows 0, 2, 5
    assert metrics["response_length/unrewarded"] == pytest.approx((3 + 1 + 6) / 3)  # rows 1, 3, 4
    expected = positive_share(batch, 0.7, 1.3, config)
    assert metrics["positive_share/start_bounds"] == pytest.approx(expected, rel=1e-12)
    # not the share at other bounds: the test could fail
    assert metrics["positive_share/start_bounds"] != pytest.approx(positive_share(batch, 0.9, 3.0))


def test_missing_kinds_are_nan_not_zero():
    mask = lengths_mask([3, 4])
    fresh = TokenBatch.fresh(torch.zeros(2), mask)
    metrics = balance_metrics(balance_sums(fresh, torch.zeros(2, dtype=torch.bool), BAPOConfig()))
    assert math.isnan(metrics["response_length/rewarded"]) and math.isnan(metrics["positive_share/start_bounds"])
    assert metrics["response_length/unrewarded"] == pytest.approx(3.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extreme_ratios_stay_finite(dtype):
    ratio = torch.tensor([[1e-30, 1e30, float("inf")], [0.0, 1.0, 65504.0]]).to(dtype)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    batch = TokenBatch(ratio=ratio, advantages=torch.tensor([1.0, -1.0]), mask=mask)
    sums = balance_sums(batch, torch.tensor([True, False]), BAPOConfig())
    assert torch.isfinite(sums).all()
    metrics = balance_metrics(sums)
    assert 0.0 <= metrics["positive_share/start_bounds"] <= 1.0
