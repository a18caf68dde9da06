"""`bapo train loss.method=<peer>`: every peer loss validates as a config with its own
parameters, and a tiny stale run trains with it."""

import math

import pytest

from bapo.core import PAPER_AGG_MODES
from bapo.core.losses import configurable_parameters
from bapo.train import ConfigError, read_metrics, train
from bapo.train.update import loss_params
from tests.helpers import arithmetic_examples, digit_share, make_config

# method -> one of its parameters set from the config
PEERS = {
    "gspo": ("upper", 1.001),
    "cispo": ("upper", 4.0),
    "cispo-verl": ("lower", 0.7),
    "sapo": ("tau_neg", 1.2),
    "gmpo": ("upper", 1.3),
    "clip-cov": ("cov_fraction", 0.01),
    "kl-cov": ("kl_coef", 0.5),
    "m2po": ("budget", 0.02),
    "m2po-official": ("budget", 0.02),
    "decoupled-ppo": ("weight_cap", 5.0),
    "dppo-tv": ("delta_high", 0.2),
    "dppo-kl": ("ratio_cap", 20.0),
}


@pytest.mark.parametrize("method", sorted(PEERS))
def test_every_peer_validates_with_its_parameters(tmp_path, method):
    name, value = PEERS[method]
    cfg = make_config("unused", tmp_path, **{"loss.method": method, f"loss.params.{name}": value})
    assert cfg.loss.resolved_agg_mode == PAPER_AGG_MODES[method]
    # loss.dual_clip reaches decoupled PPO (AReaL's c_clip); verl applies clip_ratio_c to none of the others
    expected = {name: value, "dual_clip": 3.0} if method == "decoupled-ppo" else {name: value}
    assert loss_params(cfg) == expected
    assert ("dual_clip" in configurable_parameters(method)) == (method == "decoupled-ppo")
    with pytest.raises((ConfigError, ValueError), match="loss.params.bounds: not a parameter"):
        make_config("unused", tmp_path, **{"loss.method": method, "loss.params.bounds": 1.0})


@pytest.mark.parametrize("method", ["gspo", "m2po", "clip-cov", "dppo-tv"])
def test_a_tiny_stale_run_trains_with_a_peer(tiny_model, tmp_path, method):
    overrides = {"loss.method": method, "offpolicy.async_delay": 1, "run.rollout_steps": 3, "optim.lr": 2e-2}
    rows = read_metrics(
        train(
            make_config(tiny_model, tmp_path / "run", **overrides), examples=arithmetic_examples(), verifier=digit_share
        )
    )
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert all(r["skipped"] == 0 and math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    assert max(abs(r["ratio/max"] - 1) for r in rows[1:]) > 1e-4  # stale: the method sees ratios != 1
    if method == "m2po":
        assert all("m2po/m2" in r and "clip_frac/dropped" in r for r in rows)
    if method == "gspo":
        assert all((r["lower"], r["upper"]) == (1 - 3e-4, 1 + 4e-4) for r in rows)
    if method == "dppo-tv":  # its trust region drops tokens, counted as the loss's own (dropped)
        assert all("dppo/truncated_frac" in r and "clip_frac/dropped" in r for r in rows)


def test_decoupled_ppo_trains_with_the_proximal_policy_of_each_batch(tiny_model, tmp_path):
    """bapo train fills the proximal log-probs once per rollout batch (the weights before its
    first update): with two mini-batches the second update's r' = pi / pi_prox moves off 1,
    and the stale behaviour weight pi_prox / mu is reported."""
    overrides = {
        "loss.method": "decoupled-ppo",
        "offpolicy.async_delay": 1,
        "offpolicy.mini_batches": 2,
        "run.rollout_steps": 3,
        "optim.lr": 5e-2,
    }
    rows = read_metrics(
        train(
            make_config(tiny_model, tmp_path / "run", **overrides), examples=arithmetic_examples(), verifier=digit_share
        )
    )
    assert len(rows) == 6 and all(r["skipped"] == 0 and math.isfinite(r["loss"]) for r in rows)
    weights = [r["decoupled/behaviour_weight_mean"] for r in rows]
    assert all(math.isfinite(w) for w in weights) and max(abs(w - 1) for w in weights[2:]) > 1e-4
