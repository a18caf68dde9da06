"""One optimizer update: micro-batching must not change it, and BAPO searches the whole update."""

import copy

import pytest
import torch

from bapo.core import TokenBatch, policy_loss, positive_share, search_bounds, token_ratio
from bapo.train import Trainer
from bapo.train.logprobs import token_log_probs
from bapo.train.update import behaviour_is_current, optimizer_update
from tests.helpers import arithmetic_examples, batch_log_probs, digit_share, make_config


def batch_log_prob(model, batch, cfg):
    """The current log-probs [N, R] of `batch`'s tokens under cfg's temperature (one forward)."""
    log_prob, _ = token_log_probs(
        model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, cfg.rollout.temperature
    )
    return log_prob


@pytest.fixture(scope="module")
def stale_setup(tiny_model, tmp_path_factory):
    """A model three updates past the policy that generated `batch` (ratios far from 1)."""
    cfg = make_config(
        tiny_model,
        tmp_path_factory.mktemp("run"),
        **{"optim.lr": 2e-2, "rollout.prompts_per_batch": 6, "loss.method": "bapo", "loss.bapo.target": 0.6},
    )
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    old, _ = trainer.rollout_step()
    for _ in range(3):
        trainer.update_step(trainer.rollout_step()[0])
    trainer.close()
    return trainer, old


# the peers that select no tokens over the whole batch (clip-cov, kl-cov and m2po do: split, they select apart)
@pytest.mark.parametrize("method", ["bapo", "grpo", "gspo", "cispo", "sapo", "gmpo"])
def test_micro_batches_give_the_same_update(stale_setup, method):
    trainer, batch = stale_setup
    results = []
    for micro in (len(batch), 5):
        cfg = trainer.cfg.model_copy(deep=True)
        cfg.optim.micro_batch_size, cfg.loss.method = micro, method
        model = copy.deepcopy(trainer.model)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        metrics = optimizer_update(model, opt, sched, batch, cfg)
        delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
        results.append((metrics, delta))
    (full, d_full), (split, d_split) = results
    assert split["lower"] == full["lower"] and split["upper"] == full["upper"]
    assert split["loss"] == pytest.approx(full["loss"], abs=1e-5)
    for key in (
        "tokens",
        "clip_frac",
        "clip_frac/dual",
        "positive_share",
        "quadrant/low_pos/loss_share",
        "quadrant/high_neg/count",
        "entropy_change_estimate",
        "ratio/max",
        "entropy",
    ):  # additive diagnostics
        assert split[key] == pytest.approx(full[key], rel=1e-4, abs=1e-6), key
    assert split["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-4)
    torch.testing.assert_close(d_split, d_full, atol=1e-5, rtol=1e-4)
    if method == "bapo":  # bounds of the whole update, not of any one micro-batch
        lp = batch_log_probs(trainer, batch)
        found = search_bounds(
            TokenBatch.from_log_probs(lp, batch.old_log_prob, batch.advantages, batch.response_mask),
            trainer.cfg.loss.bapo_config(),
        )
        assert (split["lower"], split["upper"]) == (found.lower, found.upper)
        assert (found.lower, found.upper) != (0.6, 1.2)  # the search moved
        assert split["bapo/search/share"] == pytest.approx(found.positive_share)
        assert split["bapo/search/tokens"] == batch.tokens and split["bapo/search/scope"] == 0.0


def test_loss_dual_clip_reaches_the_loss_and_null_turns_it_off(stale_setup):
    """loss.dual_clip caps negative tokens in grpo (default 3.0); a cap just above 1 clips many."""
    trainer, batch = stale_setup
    clipped = {}
    for dual_clip in (1.01, None):
        cfg = trainer.cfg.model_copy(deep=True)
        cfg.loss.method, cfg.loss.dual_clip = "grpo", dual_clip
        model = copy.deepcopy(trainer.model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        clipped[dual_clip] = optimizer_update(model, opt, sched, batch, cfg)["clip_frac/dual"]
    assert clipped[1.01] > 0 and clipped[None] == 0.0
    assert make_config(trainer.cfg.model.path, "unused").loss.dual_clip == 3.0


def _sgd_update(model, batch, cfg, **kwargs):
    """optimizer_update with SGD(lr=1) on a copy of `model`: (metrics, parameter delta, forward
    passes over the rows' responses; the shared-prompt forward's prompt-only pass, use_cache without
    a cache yet, is not one)."""
    model = copy.deepcopy(model)
    calls = []

    def count(_module, _args, kwargs, _out):
        if not (kwargs.get("use_cache") and kwargs.get("past_key_values") is None):
            calls.append(1)

    model.register_forward_hook(count, with_kwargs=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = optimizer_update(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), batch, cfg, **kwargs)
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    return metrics, delta, len(calls)


def test_micro_batch_scope_solves_each_micro_batch_alone(stale_setup):
    trainer, batch = stale_setup
    cfg = trainer.cfg.model_copy(deep=True)
    cfg.optim.micro_batch_size, cfg.loss.bapo.scope = 5, "micro_batch"
    metrics, delta, calls = _sgd_update(trainer.model, batch, cfg)
    assert calls == 5  # 24 rows in micro-batches of 5: no extra forward
    # reference: search_bounds on each micro-batch's ratio, policy_loss with those bounds, summed gradients
    model = copy.deepcopy(trainer.model)
    model.zero_grad()
    bapo_cfg = cfg.loss.bapo_config()
    found_all, tokens = [], []
    for start in range(0, len(batch), 5):
        mb = batch.select(torch.arange(start, min(start + 5, len(batch))))
        lp, _ = token_log_probs(
            model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, cfg.rollout.temperature
        )
        found = search_bounds(
            TokenBatch.from_log_probs(lp.detach(), mb.old_log_prob, mb.advantages, mb.response_mask), bapo_cfg
        )
        found_all.append(found)
        tokens.append(mb.tokens)
        loss, _ = policy_loss(
            lp,
            mb.old_log_prob,
            mb.advantages,
            mb.response_mask,
            "bapo",
            normalizer=float(batch.tokens),
            bounds=(found.lower, found.upper),
            dual_clip=cfg.loss.dual_clip,
        )
        loss.backward()
    expected = -torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(delta, expected, atol=1e-5, rtol=1e-4)
    assert len({(f.lower, f.upper) for f in found_all}) > 1  # micro-batches settled on different bounds
    mean_upper = sum(f.upper * n for f, n in zip(found_all, tokens)) / sum(tokens)
    assert metrics["bapo/search/upper"] == pytest.approx(mean_upper)
    assert metrics["bapo/search/scope"] == 1.0 and metrics["bapo/search/tokens"] == batch.tokens


@pytest.fixture(scope="module")
def fresh_setup(stale_setup):
    """A batch the trainer's current weights just generated (every token of version trainer.version)."""
    trainer, _ = stale_setup
    batch, _ = trainer.rollout_step()
    return trainer, batch


def test_step_scope_skips_the_forward_on_a_fresh_batch(fresh_setup):
    trainer, batch = fresh_setup
    assert behaviour_is_current(batch, trainer.version) and not behaviour_is_current(batch, trainer.version + 1)
    cfg = trainer.cfg.model_copy(deep=True)
    cfg.optim.micro_batch_size = 5
    skipped, delta_skipped, calls_skipped = _sgd_update(trainer.model, batch, cfg, version=trainer.version)
    forward, delta_forward, calls_forward = _sgd_update(trainer.model, batch, cfg)  # version unknown: no-grad pass
    micro_batches = -(-len(batch) // 5)
    # the pre-pass of a stale batch: a no-grad forward per micro-batch but the first, whose grad forward serves its loss
    assert (calls_skipped, calls_forward) == (micro_batches, 2 * micro_batches - 1)
    for key in ("bapo/search/lower", "bapo/search/upper", "bapo/search/reached", "bapo/search/steps", "lower", "upper"):
        assert skipped[key] == forward[key]
    assert skipped["bapo/search/share"] == pytest.approx(forward["bapo/search/share"], abs=1e-6)
    torch.testing.assert_close(delta_skipped, delta_forward)
    # the ratio-1 search is the search on the recomputed ratios
    with torch.no_grad():
        lp = batch_log_prob(trainer.model, batch, cfg)
    ratio = token_ratio(lp, batch.old_log_prob)
    assert (ratio[batch.response_mask] - 1).abs().max() < 1e-4
    found = search_bounds(
        TokenBatch(ratio=ratio, advantages=batch.advantages, mask=batch.response_mask), cfg.loss.bapo_config()
    )
    assert (skipped["bapo/search/lower"], skipped["bapo/search/upper"]) == (found.lower, found.upper)


def test_proximal_log_prob_reuses_the_behaviour_log_prob_where_the_current_weights_sampled(stale_setup, monkeypatch):
    """Decoupled PPO's proximal policy is the current weights: for tokens those weights sampled it
    *is* the behaviour policy, so its log-prob is the behaviour log-prob itself (weight exp(0) = 1 on
    every instruction set); tokens of older versions get the no-grad forward, and a batch with none
    runs no forward at all."""
    import dataclasses

    from bapo.train import update as update_module
    from bapo.train.update import with_proximal_log_prob

    trainer, batch = stale_setup
    version = trainer.version
    fresh_rows = torch.arange(len(batch)) < len(batch) // 2
    versions = torch.where(fresh_rows[:, None] & batch.response_mask, version, batch.versions)
    mixed = dataclasses.replace(batch, versions=versions)
    proximal = with_proximal_log_prob(trainer.model, mixed, trainer.cfg, version).proximal_log_prob
    fresh = fresh_rows[:, None] & batch.response_mask
    stale = ~fresh_rows[:, None] & batch.response_mask
    assert torch.equal(proximal[fresh], batch.old_log_prob[fresh])  # the same numbers, copied
    recomputed = batch_log_probs(trainer, batch)
    torch.testing.assert_close(proximal[stale], recomputed[stale], atol=1e-5, rtol=1e-5)  # float32 forward rounding
    assert (proximal[stale] - batch.old_log_prob[stale]).abs().max() > 1e-3  # three updates moved them

    def no_forward(*args, **kwargs):
        raise AssertionError("no forward when every token is the current version's")

    monkeypatch.setattr(update_module, "batched_log_probs", no_forward)
    all_fresh = dataclasses.replace(batch, versions=torch.where(batch.response_mask, version, batch.versions))
    assert (
        with_proximal_log_prob(trainer.model, all_fresh, trainer.cfg, version).proximal_log_prob is batch.old_log_prob
    )


@pytest.mark.parametrize("method", ["grpo", "bapo"])
def test_update_logs_lengths_by_reward_and_the_share_at_bapos_start_bounds(stale_setup, method):
    """Every update, every method: response_length/{rewarded, unrewarded} (reward > 0 or not) and
    positive_share/start_bounds (loss.bapo's start bounds, on this update's ratios), on a batch
    whose rewards and advantages are set by hand; micro-batching does not change them."""
    trainer, batch = stale_setup
    batch = copy.copy(batch)
    rows = len(batch)
    batch.rewards = torch.tensor([1.0, 0.0, 0.5, -1.0] * (rows // 4))
    batch.advantages = torch.linspace(-1.0, 1.0, rows)
    lengths = batch.response_mask.sum(1).double()
    rewarded = batch.rewards > 0
    cfg = trainer.cfg.model_copy(deep=True)
    cfg.loss.method = method
    log_prob = batch_log_prob(trainer.model, batch, cfg)
    config = cfg.loss.bapo_config()
    expected_share = positive_share(
        TokenBatch.from_log_probs(log_prob.detach(), batch.old_log_prob, batch.advantages, batch.response_mask),
        config.lower_start,
        config.upper_start,
        config,
    )
    for micro in (rows, 5):
        cfg.optim.micro_batch_size = micro
        model = copy.deepcopy(trainer.model)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        metrics = optimizer_update(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), batch, cfg)
        assert metrics["response_length/rewarded"] == pytest.approx(float(lengths[rewarded].mean()))
        assert metrics["response_length/unrewarded"] == pytest.approx(float(lengths[~rewarded].mean()))
        # the update's forward vs this test's (same weights, other micro-batch shapes): float32 rounding
        assert metrics["positive_share/start_bounds"] == pytest.approx(expected_share, rel=1e-4)
    # the stale ratios move tokens across the bounds: the share at the start bounds is not the one at 1
    at_one = positive_share(TokenBatch.fresh(batch.advantages, batch.response_mask), 0.6, 1.2)
    assert abs(expected_share - at_one) > 1e-3
