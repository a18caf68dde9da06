"""The one-pass BAPO search returns exactly what the candidate-by-candidate loop returns."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.core import BAPOConfig, BoundStats, candidate_grid, positive_share, search_bounds
from tests.core.reference import reference_search, reference_share

CONFIGS = [
    BAPOConfig(target=0.5, lower_start=0.6, lower_max=0.9, lower_step=0.05, upper_start=1.2, upper_max=3.0,
               upper_step=0.05, order="upper-first"),
    BAPOConfig(target=0.5, lower_start=0.6, lower_max=0.9, lower_step=0.05, upper_start=1.2, upper_max=3.0,
               upper_step=0.05, order="lower-first"),
    BAPOConfig(),  # paper defaults: rho0 0.4, steps 0.02 / 0.05
    BAPOConfig(target=1.0, target_kind="pos_neg", upper_step=0.1, order="lower-first"),
    BAPOConfig(target=0.7, lower_start=0.75, lower_max=0.85, lower_step=0.05, upper_start=1.1, upper_max=1.3, upper_step=0.1),
]


@st.composite
def token_batches(draw):
    """Ratios mixing exact grid values (ties at bucket edges) and free values; dyadic advantages
    so that sums of |r*A| are exact in float64 and tie comparisons are well defined."""
    cfg = draw(st.sampled_from(CONFIGS))
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, 12))
    edges = cfg.lower_grid + cfg.upper_grid
    n = batch * length
    ratio_values = draw(st.lists(
        st.one_of(st.sampled_from(edges), st.floats(0.0, 4.0, allow_nan=False, width=32),
                  st.sampled_from([0.5, 1.0, 0.25, 2.0])), min_size=n, max_size=n))
    adv_values = draw(st.lists(st.sampled_from([-2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0]), min_size=n, max_size=n))
    sign = draw(st.sampled_from(["mixed", "all-positive", "all-negative"]))
    if sign == "all-positive":
        adv_values = [abs(a) for a in adv_values]
    elif sign == "all-negative":
        adv_values = [-abs(a) for a in adv_values]
    mask_kind = draw(st.sampled_from(["random", "empty", "full"]))
    mask_values = draw(st.lists(st.booleans(), min_size=n, max_size=n)) if mask_kind == "random" else [mask_kind == "full"] * n
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    shape = (batch, length)
    return (cfg, torch.tensor(ratio_values, dtype=dtype).reshape(shape),
            torch.tensor(adv_values, dtype=dtype).reshape(shape), torch.tensor(mask_values).reshape(shape))


@settings(max_examples=300, deadline=None)
@given(token_batches())
def test_search_equals_reference_loop(case):
    cfg, ratio, advantages, mask = case
    found = search_bounds(ratio, advantages, mask, cfg)
    lower, upper, reached, steps = reference_search(ratio, advantages, mask, cfg)
    assert (found.lower, found.upper, found.reached, found.steps) == (lower, upper, reached, steps)
    assert found.positive_share == pytest.approx(reference_share(ratio, advantages, mask, lower, upper), abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(token_batches(), st.integers(1, 3))
def test_micro_batches_add_up_to_the_whole_batch(case, pieces):
    cfg, ratio, advantages, mask = case
    stats = BoundStats(cfg)
    for part in range(pieces):  # split along the batch axis, some pieces may be empty
        rows = slice(part * ratio.shape[0] // pieces, (part + 1) * ratio.shape[0] // pieces)
        stats.add(ratio[rows], advantages[rows], mask[rows])
    assert stats.solve(sync=False) == search_bounds(ratio, advantages, mask, cfg)


@settings(max_examples=200, deadline=None)
@given(token_batches(), st.integers(0, 6), st.integers(0, 36))
def test_positive_share_matches_definition_and_is_monotone(case, lower_k, upper_j):
    cfg, ratio, advantages, mask = case
    lower = cfg.lower_grid[min(lower_k, len(cfg.lower_grid) - 1)]
    upper = cfg.upper_grid[min(upper_j, len(cfg.upper_grid) - 1)]
    share = positive_share(ratio, advantages, mask, lower, upper)
    assert share == pytest.approx(reference_share(ratio, advantages, mask, lower, upper), abs=1e-12)
    # rho rises (weakly) when either bound rises.
    assert positive_share(ratio, advantages, mask, lower, upper + 0.3) >= share - 1e-12
    assert positive_share(ratio, advantages, mask, min(lower + 0.05, 0.99), upper) >= share - 1e-12


def test_random_continuous_batches_and_bf16():
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        shape = (8, 33)
        ratio = torch.exp(0.6 * torch.randn(shape, generator=generator))
        advantages = torch.randn(shape[0], generator=generator)  # one advantage per sequence
        mask = torch.rand(shape, generator=generator) > 0.3
        if trial % 2:
            ratio, advantages = ratio.bfloat16(), advantages.bfloat16()
        for cfg in CONFIGS:
            found = search_bounds(ratio, advantages, mask, cfg)
            assert (found.lower, found.upper, found.reached, found.steps)[:4] == reference_search(ratio, advantages, mask, cfg)


def test_nothing_contributes_means_share_one_and_no_move():
    ratio = torch.ones(2, 3)
    for advantages, mask in ((torch.zeros(2, 3), torch.ones(2, 3)), (torch.ones(2, 3), torch.zeros(2, 3))):
        found = search_bounds(ratio, advantages, mask, CONFIGS[0])
        assert positive_share(ratio, advantages, mask, 0.8, 1.2) == 1.0
        assert (found.lower, found.upper, found.reached, found.steps) == (0.6, 1.2, True, 0)


def test_all_negative_exhausts_the_path_and_reports_not_reached():
    cfg = CONFIGS[0]
    ratio = torch.full((2, 4), 1.0)
    found = search_bounds(ratio, -torch.ones(2, 4), torch.ones(2, 4), cfg)
    assert not found.reached
    assert (found.lower, found.upper) == (cfg.lower_grid[-1], cfg.upper_grid[-1])
    assert found.steps == len(cfg.lower_grid) + len(cfg.upper_grid) - 2


def test_upper_first_admits_low_probability_positives():
    # Positive tokens whose ratio is 2.0 count only once upper reaches 2.0.
    ratio = torch.tensor([[2.0, 1.0]])
    advantages = torch.tensor([[1.0, -1.0]])
    found = search_bounds(ratio, advantages, torch.ones(1, 2), CONFIGS[0])
    assert found.upper == pytest.approx(2.0) and found.lower == 0.6 and found.reached
    assert found.positive_share == pytest.approx(2 / 3)


def test_grid_is_built_by_multiplication():
    grid = candidate_grid(1.2, 0.05, 3.0)
    assert len(grid) == 37 and grid[-1] == 1.2 + 36 * 0.05
    assert candidate_grid(0.6, 0.02, 0.9)[7] == 0.6 + 7 * 0.02
    assert candidate_grid(0.6, 0.5, 0.9) == [0.6]


def test_pos_neg_target_is_the_share_target_in_other_units():
    generator = torch.Generator().manual_seed(1)
    ratio = torch.exp(0.5 * torch.randn(6, 20, generator=generator))
    advantages = torch.randn(6, 20, generator=generator)
    mask = torch.ones(6, 20)
    share = search_bounds(ratio, advantages, mask, BAPOConfig(target=0.6))
    pos_neg = search_bounds(ratio, advantages, mask, BAPOConfig(target=0.6 / 0.4, target_kind="pos_neg"))
    assert (share.lower, share.upper) == (pos_neg.lower, pos_neg.upper)


@pytest.mark.parametrize("kwargs, field", [
    ({"target": 1.5}, "target"), ({"target": 0.0}, "target"), ({"order": "sideways"}, "order"),
    ({"lower_start": 1.1, "lower_max": 1.2}, "lower_start"), ({"upper_start": 0.9}, "upper_start"),
    ({"upper_step": 0.0}, "upper_step"), ({"target_kind": "ratio"}, "target_kind"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BAPOConfig(**kwargs)


@pytest.mark.parametrize("bad, name", [
    ((torch.tensor([[1.0, float("nan")]]), torch.ones(1, 2), torch.ones(1, 2)), "ratio"),
    ((torch.ones(1, 2), torch.ones(1, 3), torch.ones(1, 2)), "advantages"),
    ((torch.ones(1, 2), torch.ones(1, 2), torch.tensor([[1.0, 0.5]])), "mask"),
    ((torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), torch.ones(1, 2)), "ratio"),
    ((torch.tensor([[1.0, math.inf]]), torch.ones(1, 2), torch.ones(1, 2)), "ratio"),
])
def test_bad_input_names_the_argument(bad, name):
    with pytest.raises(ValueError, match=name):
        search_bounds(*bad, CONFIGS[0])


@settings(max_examples=100, deadline=None)
@given(token_batches(), st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=48, max_size=48))
def test_weights_scale_each_tokens_contribution(case, weight_values):
    """A token of weight w counts w*|r*A|: the reference loop on advantages w*A decides the same."""
    cfg, ratio, advantages, mask = case
    weights = torch.tensor(weight_values[: ratio.numel()], dtype=ratio.dtype).reshape(ratio.shape)
    found = search_bounds(ratio, advantages, mask, cfg, weights=weights)
    assert (found.lower, found.upper, found.reached, found.steps) == reference_search(ratio, advantages * weights, mask, cfg)
    with pytest.raises(ValueError, match="weights"):
        search_bounds(ratio, advantages, mask, cfg, weights=-torch.ones_like(ratio))
