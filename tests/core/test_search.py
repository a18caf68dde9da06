"""The one-pass BAPO search returns exactly what the loop of each definition returns
(gradient share, paper Eq. 8, public recipe), token by token, on thousands of cases."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.core import (
    POLICY_LOSSES,
    BAPOConfig,
    BoundStats,
    TokenBatch,
    candidate_grid,
    positive_share,
    search_bounds,
)
from bapo.core.search import token_contributions
from tests.core.reference import (
    _tokens,
    reference_search,
    reference_share,
    reference_sums,
)

GRADIENT = [
    *(
        BAPOConfig(
            target=0.5,
            lower_start=0.6,
            lower_max=0.9,
            lower_step=0.05,
            upper_start=1.2,
            upper_max=3.0,
            upper_step=0.05,
            order=order,
        )
        for order in ("upper-first", "lower-first")
    ),
    BAPOConfig(),  # paper's search space and rho0 0.4, steps 0.02 / 0.05
    BAPOConfig(target=1.0, target_kind="pos_neg", upper_step=0.1, order="lower-first"),
    BAPOConfig(
        target=0.7, lower_start=0.75, lower_max=0.85, lower_step=0.05, upper_start=1.1, upper_max=1.3, upper_step=0.1
    ),
    BAPOConfig(target=0.6, stepping="add_clamped", lower_step=0.07, upper_step=0.3),  # clamped last steps
]
PAPER = [
    BAPOConfig.paper(),
    BAPOConfig.paper(target=0.5, lower_step=0.05),
    BAPOConfig.paper(target=0.45, order="lower-first", upper_step=0.25),
]
RECIPE = [
    BAPOConfig.recipe(),
    BAPOConfig.recipe(target=0.5 / 0.5, lower_start=0.8, lower_max=0.95, upper_step=0.1),  # its run_bapo_example.sh
    BAPOConfig.recipe(target=1.5, weighting="behaviour_prob"),
    BAPOConfig.recipe(target=0.55, target_kind="share", pos_neg_eps=0.0),
]
DEFINITIONS = {"gradient": GRADIENT, "paper": PAPER, "recipe": RECIPE}
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@st.composite
def token_batches(draw, configs=GRADIENT + PAPER + RECIPE):
    """Ratios mixing grid values rounded to the dtype (ties on bucket edges), their neighbours and
    free values; dyadic advantages and weights so that sums of r*a are exact in float64."""
    cfg = draw(st.sampled_from(configs))
    batch = draw(st.integers(1, 4))
    length = draw(st.integers(1, 12))
    dtype = draw(st.sampled_from(DTYPES))
    edges = torch.tensor(cfg.lower_grid + cfg.upper_grid, dtype=torch.float64).to(dtype)
    neighbours = (
        torch.cat(
            [
                edges,
                torch.nextafter(edges, torch.full_like(edges, 0.0)),
                torch.nextafter(edges, torch.full_like(edges, 9.0)),
            ]
        )
        .double()
        .tolist()
    )
    n = batch * length
    ratio_values = draw(
        st.lists(
            st.one_of(
                st.sampled_from(neighbours),
                st.floats(0.0, 4.0, allow_nan=False, width=32),
                st.sampled_from([0.0, 0.5, 1.0, 0.25, 2.0, 60.0]),
            ),
            min_size=n,
            max_size=n,
        )
    )
    adv_values = draw(
        st.lists(st.sampled_from([-2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0]), min_size=n, max_size=n)
    )
    sign = draw(st.sampled_from(["mixed", "mixed", "all-positive", "all-negative"]))
    if sign == "all-positive":
        adv_values = [abs(a) for a in adv_values]
    elif sign == "all-negative":
        adv_values = [-abs(a) for a in adv_values]
    mask_kind = draw(st.sampled_from(["random", "random", "empty", "full"]))
    mask_values = (
        draw(st.lists(st.booleans(), min_size=n, max_size=n)) if mask_kind == "random" else [mask_kind == "full"] * n
    )
    log_q = draw(st.lists(st.sampled_from([0.0, -math.log(2.0), -1.0, -2.5, -0.01]), min_size=n, max_size=n))
    shape = (batch, length)
    return (
        cfg,
        torch.tensor(ratio_values, dtype=torch.float64).to(dtype).reshape(shape),
        torch.tensor(adv_values, dtype=dtype).reshape(shape),
        torch.tensor(mask_values).reshape(shape),
        torch.tensor(log_q, dtype=dtype).reshape(shape),
    )


def _same_search(found, expected):
    lower, upper, reached, steps = expected
    assert (found.lower, found.upper, found.steps) == (lower, upper, steps)
    if reached is None:
        assert found.no_signal and math.isnan(found.reached) and math.isnan(found.positive_share)
        assert math.isnan(found.pos_neg)
    else:
        assert not found.no_signal and found.reached == float(reached)


@pytest.mark.parametrize("definition", sorted(DEFINITIONS))
def test_search_equals_the_reference_loop_of_each_definition(definition):
    @settings(deadline=None, derandomize=True)
    @given(token_batches(DEFINITIONS[definition]))
    def check(case):
        cfg, ratio, advantages, mask, log_q = case
        found = search_bounds(TokenBatch(ratio=ratio, advantages=advantages, mask=mask, old_log_prob=log_q), cfg)
        _same_search(found, reference_search(ratio, advantages, mask, cfg, behaviour_log_prob=log_q))
        if not found.no_signal:
            share = reference_share(ratio, advantages, mask, found.lower, found.upper, cfg, behaviour_log_prob=log_q)
            assert found.positive_share == pytest.approx(share, rel=1e-12, abs=1e-15, nan_ok=True)
            positive, negative = reference_sums(
                _tokens(ratio, advantages, mask, cfg, behaviour_log_prob=log_q), found.lower, found.upper, cfg
            )
            pos_neg = (
                positive / (negative + cfg.pos_neg_eps) if negative > 0 else (math.inf if positive > 0 else math.nan)
            )
            assert found.pos_neg == pytest.approx(pos_neg, rel=1e-12, nan_ok=True)

    check()


@settings(deadline=None, derandomize=True)
@given(token_batches(), st.integers(1, 3))
def test_micro_batches_add_up_to_the_whole_batch(case, pieces):
    cfg, ratio, advantages, mask, log_q = case
    stats = BoundStats(cfg)
    for part in range(pieces):  # split along the batch axis, some pieces may be empty
        rows = slice(part * ratio.shape[0] // pieces, (part + 1) * ratio.shape[0] // pieces)
        stats.add(TokenBatch(ratio=ratio[rows], advantages=advantages[rows], mask=mask[rows], old_log_prob=log_q[rows]))
    batch = TokenBatch(ratio=ratio, advantages=advantages, mask=mask, old_log_prob=log_q)
    found, whole = stats.solve(sync=False), search_bounds(batch, cfg)
    assert (found.lower, found.upper, found.steps, found.no_signal) == (
        whole.lower,
        whole.upper,
        whole.steps,
        whole.no_signal,
    )
    assert found.positive_share == pytest.approx(whole.positive_share, rel=1e-12, nan_ok=True)


@settings(deadline=None, derandomize=True)
@given(token_batches(), st.integers(0, 15), st.integers(0, 36))
def test_positive_share_matches_each_definition_and_moves_the_documented_way(case, lower_k, upper_j):
    cfg, ratio, advantages, mask, log_q = case
    lower = cfg.lower_grid[min(lower_k, len(cfg.lower_grid) - 1)]
    upper = cfg.upper_grid[min(upper_j, len(cfg.upper_grid) - 1)]
    batch = TokenBatch(ratio=ratio, advantages=advantages, mask=mask, old_log_prob=log_q)
    share = positive_share(batch, lower, upper, cfg)
    expected = reference_share(ratio, advantages, mask, lower, upper, cfg, behaviour_log_prob=log_q)
    assert share == pytest.approx(expected, rel=1e-12, abs=1e-15, nan_ok=True)
    if math.isnan(share):
        return
    wider_upper = positive_share(batch, lower, upper + 0.3, cfg)
    higher_lower = positive_share(batch, min(lower + 0.05, 0.99), upper, cfg)
    assert wider_upper >= share - 1e-12  # raising c_high admits (or counts more of) positive tokens
    if cfg.contribution == "gradient":
        assert higher_lower >= share - 1e-12 or math.isnan(higher_lower)  # drops low-probability negatives
    else:
        assert higher_lower <= share + 1e-12  # Eq. 8: negatives count at max(r, c_low), which rises


@pytest.mark.parametrize("cfg", [GRADIENT[0], GRADIENT[5], PAPER[0], RECIPE[0], RECIPE[1]], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_arithmetic_bucket_equals_the_count_of_candidates_on_every_float_near_every_edge(cfg, dtype):
    """positive tokens: #{upper candidates < r}; the others: #{lower candidates <= r}, decided in
    float64 for every value within 40 ulps of every candidate in `dtype` (and bf16 exhaustively)."""
    edges = torch.tensor(cfg.lower_grid + cfg.upper_grid + [0.0, 1.0, 5.0], dtype=torch.float64).to(dtype)
    values = [edges]
    for direction in (-math.inf, math.inf):
        current = edges
        for _ in range(40):
            current = torch.nextafter(current, torch.full_like(current, direction))
            values.append(current)
    values.append(torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).mul(3.5).to(dtype))
    if dtype == torch.bfloat16:  # every bf16 value in [0, 8)
        values.append(torch.arange(0, 0x4100, dtype=torch.int16).view(torch.bfloat16))
    ratio = torch.cat(values).clamp_min(0.0)
    ratio = ratio[torch.isfinite(ratio)]
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    stats = BoundStats(cfg)
    stats._ensure(torch.device("cpu"))
    r64 = ratio.double()[:, None]
    upper_count = (torch.tensor(cfg.upper_grid, dtype=torch.float64) < r64).sum(1)
    lower_count = (torch.tensor(cfg.lower_grid, dtype=torch.float64) <= r64).sum(1)
    for positive, expected in ((True, upper_count), (False, lower_count + len(cfg.upper_grid) + 1)):
        side = torch.full(ratio.shape, positive)
        assert torch.equal(stats._buckets(ratio.to(compute), side), expected)


def test_random_continuous_batches_bf16_and_weights():
    generator = torch.Generator().manual_seed(0)
    for trial in range(30):
        shape = (8, 33)
        ratio = torch.exp(0.6 * torch.randn(shape, generator=generator))
        advantages = torch.randn(shape[0], generator=generator)  # one advantage per sequence
        mask = torch.rand(shape, generator=generator) > 0.3
        log_q = -3 * torch.rand(shape, generator=generator)
        weights = torch.rand(shape, generator=generator) * 2
        if trial % 2:
            ratio, advantages, log_q = ratio.bfloat16(), advantages.bfloat16(), log_q.bfloat16()
        batch = TokenBatch(
            ratio=ratio, advantages=advantages, mask=mask, old_log_prob=log_q, importance_weights=weights
        )
        for cfg in GRADIENT + PAPER + RECIPE:
            found = search_bounds(batch, cfg)
            expected = reference_search(ratio, advantages, mask, cfg, weights=weights, behaviour_log_prob=log_q)
            _same_search(found, expected)


def test_no_signal_is_missing_not_one():
    ratio = torch.ones(2, 3)
    for cfg in (GRADIENT[0], PAPER[0], RECIPE[0]):
        for advantages, mask in ((torch.zeros(2, 3), torch.ones(2, 3)), (torch.ones(2, 3), torch.zeros(2, 3))):
            batch = TokenBatch(ratio=ratio, advantages=advantages, mask=mask, old_log_prob=torch.zeros(2, 3))
            found = search_bounds(batch, cfg)
            assert found.no_signal and (found.lower, found.upper, found.steps) == (cfg.lower_start, cfg.upper_start, 0)
            assert all(math.isnan(v) for v in (found.positive_share, found.reached, found.pos_neg))
            assert math.isnan(positive_share(batch, 0.8, 1.2, cfg))
            assert found.metrics()["no_signal"] == 1.0


def test_all_negative_exhausts_the_path_and_reports_not_reached():
    cfg = GRADIENT[0]
    found = search_bounds(
        TokenBatch(ratio=torch.full((2, 4), 1.0), advantages=-torch.ones(2, 4), mask=torch.ones(2, 4)), cfg
    )
    assert found.reached == 0.0 and not found.no_signal and found.positive_share == 0.0
    assert (found.lower, found.upper) == (cfg.lower_grid[-1], cfg.upper_grid[-1])
    assert found.steps == len(cfg.lower_grid) + len(cfg.upper_grid) - 2


def test_upper_first_admits_low_probability_positives():
    # Positive tokens whose ratio is 2.0 count only once upper reaches 2.0.
    batch = TokenBatch(ratio=torch.tensor([[2.0, 1.0]]), advantages=torch.tensor([[1.0, -1.0]]), mask=torch.ones(1, 2))
    found = search_bounds(batch, GRADIENT[0])
    assert found.upper == pytest.approx(2.0) and found.lower == 0.6 and found.reached == 1.0
    assert found.positive_share == pytest.approx(2 / 3) and found.pos_neg == pytest.approx(2.0)


def test_the_definitions_choose_different_bounds_on_one_batch():
    """A worked example: a stale positive token (r = 2.4) and negatives at r = 1 and r = 0.5."""
    ratio = torch.tensor([[2.4, 1.0, 0.5]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -1.0, -1.0]], dtype=torch.float64)
    log_q = torch.log(torch.tensor([[0.25, 0.5, 0.5]], dtype=torch.float64))
    batch = TokenBatch(ratio=ratio, advantages=advantages, mask=torch.ones(1, 3), old_log_prob=log_q)
    # gradient: at (0.6, 1.2) pos 0 / neg 1.0 (r=0.5 clipped); upper reaches 2.4 -> share 2.4/3.4 >= 0.5.
    gradient = search_bounds(batch, BAPOConfig(target=0.5, lower_step=0.05))
    assert gradient.upper == pytest.approx(2.4) and gradient.positive_share == pytest.approx(2.4 / 3.4)
    # recipe: pos min(2.4, c_high), neg 1 + max(0.5, c_low) = 1.6..1.8; lower first to 0.8 (1.8), then
    # upper up to 2.0 (pos 2.0 >= 1.8 at c_high 1.8 + eps): the first c_high with c_high / 1.8 >= 1.
    recipe = search_bounds(batch, BAPOConfig.recipe())
    assert (recipe.lower, recipe.upper) == (0.8, pytest.approx(1.85)) and recipe.reached == 1.0
    # paper Eq. 8: pos 0.25*min(2.4, c_high), neg 0.5*(1 + max(0.5, c_low)) = 0.8 at the start:
    # share 0.3/1.1 < 0.4 at c_high 1.2; 0.25*c_high / (0.25*c_high + 0.8) >= 0.4 needs c_high >= 2.1333.
    paper = search_bounds(batch, BAPOConfig.paper())
    assert (paper.lower, paper.upper) == (0.6, pytest.approx(2.15))
    assert paper.positive_share == pytest.approx(0.25 * 2.15 / (0.25 * 2.15 + 0.8))


def test_presets_are_the_papers_and_the_recipes():
    paper, recipe = BAPOConfig.paper(), BAPOConfig.recipe()
    assert (paper.contribution, paper.weighting, paper.target, paper.target_kind, paper.order) == (
        "clamped",
        "behaviour_prob",
        0.4,
        "share",
        "upper-first",
    )
    assert (paper.lower_grid[-1], len(paper.lower_grid), paper.upper_grid[-1], len(paper.upper_grid)) == (
        pytest.approx(0.9),
        16,
        pytest.approx(3.0),
        37,
    )
    assert (
        recipe.contribution,
        recipe.weighting,
        recipe.target,
        recipe.target_kind,
        recipe.order,
        recipe.pos_neg_eps,
    ) == ("clamped", "none", 1.0, "pos_neg", "lower-first", 1e-8)
    assert recipe.lower_grid == [0.6, 0.6 + 0.05, 0.6 + 0.05 + 0.05, 0.6 + 0.05 + 0.05 + 0.05, 0.8]  # float additions
    assert recipe.upper_grid[-1] == 2.0 and BAPOConfig() == BAPOConfig(contribution="gradient", weighting="none")


def test_behaviour_prob_weighting_needs_the_behaviour_log_prob():
    ones = torch.ones(1, 2)
    with pytest.raises(ValueError, match="^old_log_prob: required"):
        search_bounds(TokenBatch(ratio=ones, advantages=ones, mask=ones), BAPOConfig.paper())
    with pytest.raises(ValueError, match="^old_log_prob: must be <= 0"):  # a log-prob > 0
        search_bounds(TokenBatch(ratio=ones, advantages=ones, mask=ones, old_log_prob=ones), BAPOConfig.paper())


def test_a_batch_without_log_probs_serves_the_search_and_no_loss():
    """A TokenBatch built from a ratio alone holds no made-up log-probs: the search runs on it, and a
    loss that reads the log-probs refuses it naming the missing field."""
    batch = TokenBatch(ratio=torch.tensor([[2.0, 1.0]]), advantages=torch.tensor([1.0]), mask=torch.ones(1, 2))
    assert not search_bounds(batch, GRADIENT[0]).no_signal
    with pytest.raises(ValueError, match="^log_prob: "):
        POLICY_LOSSES["topr"](batch)
    with pytest.raises(ValueError, match="^old_log_prob: "):
        POLICY_LOSSES["dcpo"](dataclasses.replace(batch, log_prob=torch.zeros(1, 2)))


def test_a_fresh_batch_has_ratio_one_in_the_behaviour_log_probs_precision():
    old_log_prob = torch.full((2, 3), -0.5, dtype=torch.float64)
    fresh = TokenBatch.fresh(torch.ones(2), torch.ones(2, 3), old_log_prob=old_log_prob)
    assert fresh.ratio.dtype == torch.float64 and bool((fresh.ratio == 1.0).all())
    assert fresh.log_prob is old_log_prob and fresh.old_log_prob is old_log_prob  # the current policy sampled
    assert TokenBatch.fresh(torch.ones(2), torch.ones(2, 3)).ratio.dtype == torch.float32


def test_token_contributions_sum_to_the_searched_share():
    generator = torch.Generator().manual_seed(3)
    ratio = torch.exp(0.5 * torch.randn(4, 9, generator=generator))
    advantages, log_q = torch.randn(4, 9, generator=generator), -torch.rand(4, 9, generator=generator)
    for cfg in (GRADIENT[2], PAPER[0], RECIPE[0]):
        batch = TokenBatch(ratio=ratio, advantages=advantages, mask=torch.ones(4, 9), old_log_prob=log_q)
        found = search_bounds(batch, cfg)
        positive, negative = token_contributions(batch, found.lower, found.upper, cfg)
        assert found.positive_share == pytest.approx(
            float(positive.sum() / (positive.sum() + negative.sum())), rel=1e-12
        )


def test_grid_is_built_by_multiplication_or_by_the_recipes_clamped_additions():
    grid = candidate_grid(1.2, 0.05, 3.0)
    assert len(grid) == 37 and grid[-1] == 1.2 + 36 * 0.05
    assert candidate_grid(0.6, 0.02, 0.9)[7] == 0.6 + 7 * 0.02
    assert candidate_grid(0.6, 0.5, 0.9) == [0.6]
    assert candidate_grid(0.6, 0.5, 0.9, "add_clamped") == [0.6, 0.9]


def test_pos_neg_target_is_the_share_target_in_other_units():
    generator = torch.Generator().manual_seed(1)
    ratio = torch.exp(0.5 * torch.randn(6, 20, generator=generator))
    advantages = torch.randn(6, 20, generator=generator)
    batch = TokenBatch(ratio=ratio, advantages=advantages, mask=torch.ones(6, 20))
    share = search_bounds(batch, BAPOConfig(target=0.6))
    pos_neg = search_bounds(batch, BAPOConfig(target=0.6 / 0.4, target_kind="pos_neg"))
    assert (share.lower, share.upper) == (pos_neg.lower, pos_neg.upper)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"target": 1.5}, "target"),
        ({"target": 0.0}, "target"),
        ({"order": "sideways"}, "order"),
        ({"lower_start": 1.1, "lower_max": 1.2}, "lower_start"),
        ({"upper_start": 0.9}, "upper_start"),
        ({"upper_step": 0.0}, "upper_step"),
        ({"target_kind": "ratio"}, "target_kind"),
        ({"contribution": "signed"}, "contribution"),
        ({"weighting": "q"}, "weighting"),
        ({"stepping": "log"}, "stepping"),
        ({"pos_neg_eps": -1.0}, "pos_neg_eps"),
        ({"target_mode": "pid"}, "target_mode"),
        ({"target_mode": "entropy", "target_min": 0.5}, "target_min"),
        ({"target_mode": "entropy", "target_gain": -1.0}, "target_gain"),
        ({"target_mode": "entropy", "target_hold_updates": 0}, "target_hold_updates"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BAPOConfig(**kwargs)


@pytest.mark.parametrize(
    "bad, name",
    [
        ((torch.tensor([[1.0, float("nan")]]), torch.ones(1, 2), torch.ones(1, 2)), "ratio"),
        ((torch.ones(1, 2), torch.ones(1, 3), torch.ones(1, 2)), "advantages"),
        ((torch.ones(1, 2), torch.ones(1, 2), torch.tensor([[1.0, 0.5]])), "mask"),
        ((torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), torch.ones(1, 2)), "ratio"),
        ((torch.tensor([[1.0, math.inf]]), torch.ones(1, 2), torch.ones(1, 2)), "ratio"),
    ],
)
def test_bad_input_names_the_argument(bad, name):
    ratio, advantages, mask = bad
    with pytest.raises(ValueError, match=f"^{name}: "):
        search_bounds(TokenBatch(ratio=ratio, advantages=advantages, mask=mask), GRADIENT[0])


@settings(deadline=None, derandomize=True)
@given(token_batches(), st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=48, max_size=48))
def test_weights_scale_each_tokens_magnitude(case, weight_values):
    """A token of weight w counts with w*|A|: the reference loop on the same weights decides the same."""
    cfg, ratio, advantages, mask, log_q = case
    weights = torch.tensor(weight_values[: ratio.numel()], dtype=ratio.dtype).reshape(ratio.shape)
    batch = TokenBatch(ratio=ratio, advantages=advantages, mask=mask, old_log_prob=log_q, importance_weights=weights)
    found = search_bounds(batch, cfg)
    _same_search(found, reference_search(ratio, advantages, mask, cfg, weights=weights, behaviour_log_prob=log_q))
    with pytest.raises(ValueError, match="^importance_weights: must be >= 0"):
        search_bounds(dataclasses.replace(batch, importance_weights=-torch.ones_like(ratio)), cfg)
