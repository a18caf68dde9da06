"""BAPOStep: the per-update protocol every front end shares (scope, pre-pass, shortcut, metrics, state)."""

import json
import math
import warnings

import pytest
import torch

from bapo.core import (
    BAPOConfig,
    BAPOStep,
    BoundStats,
    MissingStepStateWarning,
    TokenBatch,
    search_bounds,
    token_ratio,
)


def micro_batches(count: int = 3, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Micro-batches [4, 6] of stale ratios (spread ~[0.3, 3]) with mixed-sign advantages."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        old = -torch.rand(4, 6, generator=generator) * 3
        log_prob = old + 0.6 * torch.randn(4, 6, generator=generator)
        batches.append(
            {
                "ratio": token_ratio(log_prob, old),
                "advantages": torch.randn(4, generator=generator),
                "mask": torch.rand(4, 6, generator=generator) > 0.2,
                "behaviour_log_prob": old,
            }
        )
    return batches


def search_batch(batch: dict) -> TokenBatch:
    return TokenBatch(ratio=batch["ratio"], advantages=batch["advantages"], mask=batch["mask"])


def test_step_scope_solves_once_over_every_micro_batch():
    config = BAPOConfig(target=0.55, lower_step=0.05)
    batches = micro_batches()
    step = BAPOStep(config)
    step.begin(micro_batches=len(batches))
    assert step.needs_pre_pass()
    for batch in batches:
        step.observe(search_batch(batch))
    solved = step.solve(sync=False)
    expected = BoundStats(config)
    for batch in batches:
        expected.add(search_batch(batch))
    assert solved == expected.solve(sync=False) == step.solved
    # every micro-batch's loss gets the step's bounds, whatever its own ratios say
    alone = [search_bounds(search_batch(batch), config) for batch in batches]
    assert len({(found.lower, found.upper) for found in alone}) > 1
    assert all(step.bounds_for(search_batch(batch)) == solved for batch in batches)
    metrics = step.metrics()
    tokens = sum(int(batch["mask"].sum()) for batch in batches)
    assert (metrics["bapo/search/lower"], metrics["bapo/search/upper"]) == (solved.lower, solved.upper)
    assert metrics["bapo/search/tokens"] == tokens and metrics["bapo/search/scope"] == 0.0
    assert metrics["bapo/target"] == 0.55


def test_micro_batch_scope_searches_each_micro_batch_and_needs_no_pre_pass():
    config = BAPOConfig(target=0.55, lower_step=0.05, scope="micro_batch")
    batches = micro_batches()
    step = BAPOStep(config)
    step.begin(micro_batches=len(batches))
    assert not step.needs_pre_pass() and not step.needs_pre_pass(fresh=True)
    found = [step.bounds_for(search_batch(batch)) for batch in batches]
    assert found == [search_bounds(search_batch(batch), config) for batch in batches]
    counts = [int(batch["mask"].sum()) for batch in batches]
    metrics = step.metrics()
    assert metrics["bapo/search/upper"] == pytest.approx(sum(f.upper * n for f, n in zip(found, counts)) / sum(counts))
    assert metrics["bapo/search/scope"] == 1.0 and metrics["bapo/search/tokens"] == sum(counts)
    latest = step.metrics(step.searches[-1:])  # what verl logs per micro-batch
    assert latest["bapo/search/upper"] == found[-1].upper and latest["bapo/search/tokens"] == counts[-1]


def test_step_scope_with_one_micro_batch_searches_it_from_its_own_forward():
    config = BAPOConfig(target=0.55, lower_step=0.05)
    (batch,) = micro_batches(1)
    step = BAPOStep(config)
    step.begin(micro_batches=1)
    assert not step.needs_pre_pass() and step.needs_pre_pass(fresh=True)  # fresh: the pre-pass is free
    assert step.bounds_for(search_batch(batch)) == search_bounds(search_batch(batch), config)
    assert len(step.searches) == 1


def test_step_scope_refuses_bounds_before_the_pre_pass():
    step = BAPOStep(BAPOConfig())
    step.begin(micro_batches=2)
    with pytest.raises(RuntimeError, match="observe on every micro-batch and solve"):
        step.bounds_for(search_batch(micro_batches(1)[0]))


def test_fresh_batch_observes_ratio_one_without_a_ratio():
    config = BAPOConfig(target=0.55, lower_step=0.05)
    batches = micro_batches()
    fresh, explicit = BAPOStep(config), BAPOStep(config)
    for step in (fresh, explicit):
        step.begin(micro_batches=len(batches))
    for batch in batches:
        fresh.observe(TokenBatch.fresh(batch["advantages"], batch["mask"], old_log_prob=batch["behaviour_log_prob"]))
        explicit.observe(TokenBatch(ratio=torch.ones(4, 6), advantages=batch["advantages"], mask=batch["mask"]))
    assert fresh.solve(sync=False) == explicit.solve(sync=False)


def test_begin_starts_each_update_afresh():
    config = BAPOConfig(target=0.55, lower_step=0.05)
    first, second = micro_batches(2, seed=1), micro_batches(2, seed=2)
    step = BAPOStep(config)
    for batches in (first, second):
        step.begin(micro_batches=2)
        for batch in batches:
            step.observe(search_batch(batch))
        solved = step.solve(sync=False)
        step.end()
    alone = BAPOStep(config)
    alone.begin(micro_batches=2)
    for batch in second:
        alone.observe(search_batch(batch))
    assert solved == alone.solve(sync=False) and len(step.searches) == 1


def entropy_config(**overrides) -> BAPOConfig:
    return BAPOConfig(
        target=0.5,
        target_mode="entropy",
        target_hold_updates=1,
        target_gain=2.0,
        target_min=0.1,
        target_max=0.9,
        **overrides,
    )


def test_end_feeds_the_controller_the_recorded_token_mean_entropy():
    step, reference = BAPOStep(entropy_config()), BAPOStep(entropy_config())
    entropies = [(torch.full((2, 3), 1.0), torch.ones(2, 3)), (torch.full((2, 3), 0.25), torch.ones(2, 3))]
    for entropy, mask in entropies:
        step.begin()
        masked = torch.where(torch.arange(3) < 2, entropy, float("nan"))  # NaN under the mask is never read
        step.record_entropy(masked, mask * (torch.arange(3) < 2))
        step.end()
        reference.begin()
        reference.end(float(entropy[0, 0]))
    assert step.controller.state_dict() == reference.controller.state_dict()
    assert step.target > 0.5  # entropy fell below the held set point: rho0 rises
    held = BAPOStep(entropy_config())
    held.begin()
    held.end()  # nothing recorded: NaN, rho0 unchanged
    assert held.target == 0.5 and held.controller.set_point is None


def test_state_round_trips_through_json_and_a_fresh_step_resumes_exactly():
    step = BAPOStep(entropy_config())
    for entropy in (1.0, 0.6, 0.5):
        step.begin()
        step.end(entropy)
    state = json.loads(json.dumps(step.state_dict()))  # TRL and verl write it as JSON
    resumed = BAPOStep(entropy_config())
    resumed.load_state_dict(state)
    assert resumed.state_dict() == step.state_dict() and resumed.target == step.target
    for each in (step, resumed):
        each.begin()
        each.end(0.4)
    assert resumed.target == step.target != 0.5


def test_missing_state_warns_in_entropy_mode_and_starts_afresh():
    step = BAPOStep(entropy_config())
    step.begin()
    step.end(1.0)
    with pytest.warns(MissingStepStateWarning, match="checkpoint-7 has no entropy-controller state"):
        step.load_state_dict(None, source="checkpoint-7")
    assert step.state_dict() == BAPOStep(entropy_config()).state_dict()
    fixed = BAPOStep(BAPOConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed.load_state_dict(None)  # fixed rho0: nothing to restore, nothing to warn about
    assert fixed.target == 0.4 and math.isfinite(fixed.target)


def test_padding_ratios_are_never_read():
    """A forward's padding may hold inf or NaN ratios: the search ignores them (validate=False path)."""
    config = BAPOConfig(target=0.55, lower_step=0.05, scope="micro_batch")
    (batch,) = micro_batches(1)
    padded = torch.where(batch["mask"], batch["ratio"], float("nan"))
    padded[0, -1] = float("inf") if not batch["mask"][0, -1] else padded[0, -1]
    step = BAPOStep(config)
    step.begin()
    padded_batch = TokenBatch(ratio=padded, advantages=batch["advantages"], mask=batch["mask"])
    assert step.bounds_for(padded_batch) == search_bounds(search_batch(batch), config)
