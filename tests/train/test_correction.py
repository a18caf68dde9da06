"""Rollout correction (rollout.backend=vllm): the weights against loops written from the formula
(verl's compute_rollout_correction_weights, TRL's vllm_importance_sampling_correction), and the
same weights in the loss and in BAPO's bound search. No vLLM needed."""

import copy
import math

import pytest
import torch

from bapo.core import BAPOStep, off_policy_sequence_mask
from bapo.train import update as update_module
from bapo.train.correction import correction_weights, mismatch_metrics
from bapo.train.update import optimizer_update
from tests.train.test_update import stale_setup  # noqa: F401  (fixture)


def _inputs(seed=0, rows=5, width=7, scale=0.6):
    gen = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(rows, width, generator=gen) * 3
    engine = trainer + torch.randn(rows, width, generator=gen) * scale
    lengths = [7, 3, 1, 5, 0][:rows]
    mask = torch.tensor([[col < length for col in range(width)] for length in lengths])
    return trainer, engine, mask


def _loop(trainer, engine, mask, mode, level, cap, lower):
    """The formula, one token at a time: w = exp(clamp(log pi_trainer - log pi_engine, +-20)),
    the sequence level taking the sum of the row's log-ratios; tis = min(w, cap); mis and icepop
    = w in [lower, cap] else 0; padding 0."""
    rows, width = mask.shape
    out = [[0.0] * width for _ in range(rows)]
    for i in range(rows):
        seq = sum(float(trainer[i, j]) - float(engine[i, j]) for j in range(width) if mask[i, j])
        for j in range(width):
            if not mask[i, j]:
                continue
            log_ratio = seq if level == "sequence" else float(trainer[i, j]) - float(engine[i, j])
            w = math.exp(min(max(log_ratio, -20.0), 20.0))
            if mode == "tis":
                w = min(w, cap)
            elif mode in ("mis", "icepop"):
                w = w if lower <= w <= cap else 0.0
            out[i][j] = w
    return torch.tensor(out)


@pytest.mark.parametrize("mode", ["tis", "mis", "icepop"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap, lower", [(2.0, 0.0), (1.2, 0.5)])
def test_weights_match_the_formula(mode, level, cap, lower):
    trainer, engine, mask = _inputs()
    weights, ratio = correction_weights(trainer, engine, mask, mode, level, cap, lower)
    expected = _loop(trainer, engine, mask, mode, level, cap, lower)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-7)
    raw = _loop(trainer, engine, mask, "none", level, cap, lower)
    torch.testing.assert_close(ratio[mask], raw[mask], rtol=1e-6, atol=1e-7)
    assert (weights[~mask] == 0).all()


@pytest.mark.verl
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("lower, cap", [(0.5, 5.0), (0.8, 1.25)])
def test_icepop_equals_verls_rollout_correction(level, lower, cap):
    """IcePop = verl's compute_rollout_correction_weights with a "lower_upper" threshold (its
    decoupled_token_icepop preset: "0.5_5.0"): the ratio inside [lower, upper], 0 outside."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    trainer, engine, mask = _inputs(scale=1.0)
    weights, _ = correction_weights(trainer, engine, mask, "icepop", level, cap, lower)
    expected, metrics = helper.compute_rollout_correction_weights(
        (trainer - engine).double(), mask.double(), rollout_is=level, rollout_is_threshold=f"{lower}_{cap}"
    )
    # float32 weights against verl's float64: float32 rounding of exp
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-7)
    zeroed = ((weights == 0) & mask).sum() / mask.sum()
    assert 0 < float(zeroed) == pytest.approx(metrics["rollout_is_oob_ratio"])  # both tails met here


def test_icepop_config_defaults_and_checks(tmp_path):
    from bapo.train import ConfigError
    from tests.helpers import make_config

    icepop = {"rollout.backend": "vllm", "rollout.correction": "icepop"}
    cfg = make_config("unused", tmp_path, **icepop)
    assert (cfg.rollout.correction_lower, cfg.rollout.correction_cap) == (0.5, 5.0)
    cfg = make_config("unused", tmp_path, **icepop, **{"rollout.correction_cap": 3.0})
    assert (cfg.rollout.correction_lower, cfg.rollout.correction_cap) == (0.5, 3.0)
    with pytest.raises(ConfigError, match="rollout.correction_lower=0: icepop masks both tails"):
        make_config("unused", tmp_path, **icepop, **{"rollout.correction_lower": 0.0})
    with pytest.raises(ConfigError, match="rollout.correction_lower=0.5 must be below rollout.correction_cap=0.4"):
        make_config("unused", tmp_path, **icepop, **{"rollout.correction_cap": 0.4})


def test_none_gives_no_weights_and_the_gap_metrics():
    trainer, engine, mask = _inputs()
    weights, ratio = correction_weights(trainer, engine, mask, "none")
    assert weights is None
    metrics = mismatch_metrics(trainer, engine, mask, ratio, weights, cap=2.0)
    diffs = [abs(float(trainer[i, j] - engine[i, j])) for i in range(5) for j in range(7) if mask[i, j]]
    ratios = [math.exp(float(trainer[i, j] - engine[i, j])) for i in range(5) for j in range(7) if mask[i, j]]
    assert metrics["rollout/logp_diff/mean"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-6)
    assert metrics["rollout/logp_diff/max"] == pytest.approx(max(diffs), rel=1e-6)
    assert metrics["rollout/is_ratio/mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert metrics["rollout/is_ratio/max"] == pytest.approx(max(ratios), rel=1e-5)
    assert metrics["rollout/is_ratio/above_cap"] == pytest.approx(sum(r > 2.0 for r in ratios) / len(ratios))
    assert "rollout/is_weight/mean" not in metrics


def test_safety_bound_clamps_the_sequence_log_ratio():
    trainer = torch.zeros(1, 30)
    engine = torch.full((1, 30), -1.0)  # sum of log-ratios 30 > 20
    mask = torch.ones(1, 30, dtype=torch.bool)
    _, ratio = correction_weights(trainer, engine, mask, "tis", "sequence", cap=2.0)
    assert float(ratio[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-6)


@pytest.mark.parametrize(
    "mode, level, lower",
    [("tis", "token", 0.0), ("mis", "sequence", 0.0), ("icepop", "token", 0.8), ("none", "token", 0.0)],
)
def test_loss_and_bapo_search_get_the_same_weights(stale_setup, monkeypatch, mode, level, lower):  # noqa: F811
    trainer, batch = stale_setup
    batch = copy.copy(batch)
    gen = torch.Generator().manual_seed(1)
    batch.engine_log_prob = batch.old_log_prob + torch.randn(batch.old_log_prob.shape, generator=gen) * 0.2
    cfg = trainer.cfg.model_copy(deep=True)
    cfg.rollout.backend, cfg.rollout.correction_lower = "vllm", lower
    cfg.rollout.correction, cfg.rollout.correction_level = mode, level
    cfg.rollout.correction_cap, cfg.optim.micro_batch_size = 1.5, 7  # several micro-batches: a pre-pass
    expected, _ = correction_weights(
        batch.old_log_prob, batch.engine_log_prob, batch.response_mask, mode, level, 1.5, lower
    )
    seen = _spy_on_weights(monkeypatch)
    model = copy.deepcopy(trainer.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    metrics = optimizer_update(model, opt, sched, batch, cfg)
    seen.pop("log_prob")
    assert len(seen["loss"]) == len(seen["observe"]) == len(seen["bounds_for"]) == math.ceil(len(batch) / 7)
    if mode == "none":
        assert all(w is None for ws in seen.values() for w in ws)
    else:
        for name, parts in seen.items():
            torch.testing.assert_close(torch.cat(parts), expected, msg=name)
        assert "rollout/is_weight/mean" in metrics
    assert metrics["rollout/logp_diff/max"] == pytest.approx(
        float((batch.old_log_prob - batch.engine_log_prob).abs()[batch.response_mask].max()), rel=1e-5
    )


@pytest.mark.parametrize("engine", [False, True])
def test_off_policy_mask_reaches_the_loss_and_bapo_search_alike(stale_setup, monkeypatch, engine):  # noqa: F811
    """loss.off_policy_mask: the weights the loss and BAPO's search get are the correction's times
    OPSM's keep mask of the current log-probs against the sampler (the engine when there is one)."""
    trainer, batch = stale_setup
    batch = copy.copy(batch)
    cfg = trainer.cfg.model_copy(deep=True)
    cfg.loss.off_policy_mask, cfg.optim.micro_batch_size = 0.05, 7
    if engine:
        gen = torch.Generator().manual_seed(2)
        batch.engine_log_prob = batch.old_log_prob + torch.randn(batch.old_log_prob.shape, generator=gen) * 0.2
        cfg.rollout.backend, cfg.rollout.correction = "vllm", "tis"
    seen = _spy_on_weights(monkeypatch)
    model = copy.deepcopy(trainer.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer_update(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), batch, cfg)
    current = torch.cat(seen.pop("log_prob"))  # the current policy's log-probs, as the loss got them
    sampler = batch.engine_log_prob if engine else batch.old_log_prob
    expected = off_policy_sequence_mask(current, sampler, batch.advantages, batch.response_mask, 0.05)
    if engine:
        expected = expected * correction_weights(
            batch.old_log_prob, batch.engine_log_prob, batch.response_mask, "tis", "token", 2.0
        )[0].to(expected.dtype)
    masked_rows = (expected.sum(-1) == 0) & batch.response_mask.any(-1)
    assert bool(masked_rows.any()) and bool((batch.advantages[masked_rows] < 0).all())
    # the pre-pass's forward of a later micro-batch runs without grad, the loss's with: float32 rounding apart
    for name, parts in seen.items():
        torch.testing.assert_close(torch.cat(parts), expected.float(), rtol=1e-5, atol=1e-6, msg=name)


def _spy_on_weights(monkeypatch) -> dict[str, list]:
    """Record the weights policy_loss, BAPOStep.observe and BAPOStep.bounds_for are called with."""
    seen: dict[str, list] = {"loss": [], "observe": [], "bounds_for": []}
    real_loss, real_observe, real_bounds = update_module.policy_loss, BAPOStep.observe, BAPOStep.bounds_for

    def loss(*args, importance_weights=None, **kwargs):
        seen["loss"].append(importance_weights)
        seen.setdefault("log_prob", []).append(args[0].detach())
        return real_loss(*args, importance_weights=importance_weights, **kwargs)

    def observe(self, batch, **kwargs):
        seen["observe"].append(batch.importance_weights)
        return real_observe(self, batch, **kwargs)

    def bounds_for(self, batch, **kwargs):
        seen["bounds_for"].append(batch.importance_weights)
        return real_bounds(self, batch, **kwargs)

    monkeypatch.setattr(update_module, "policy_loss", loss)
    monkeypatch.setattr(BAPOStep, "observe", observe)
    monkeypatch.setattr(BAPOStep, "bounds_for", bounds_for)
    return seen
