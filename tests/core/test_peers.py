"""The peer losses (bapo.core.peers): each against a loop written from its paper's formula
(tests/core/reference_peers.py), against the framework's own function where one exists (verl
0.9.1's core_algos; skipped when verl is missing), and their diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from bapo.core import PAPER_AGG_MODES, off_policy_sequence_mask, policy_loss
from tests.core import reference_peers as ref

BATCH, LENGTH = 6, 7


def random_batch(seed: int, spread: float = 0.3, lengths=(7, 5, 3, 6, 1, 4)):
    """float64 tensors: log-probs near -1, log-ratios ~ N(0, spread^2), one advantage per
    sequence (both signs), ragged masks (no empty row: verl's seq-mean skips empty rows)."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(BATCH, LENGTH, generator=generator, dtype=torch.float64) * 2.0
    log_prob = old + spread * torch.randn(BATCH, LENGTH, generator=generator, dtype=torch.float64)
    advantages = torch.randn(BATCH, generator=generator, dtype=torch.float64)
    mask = (torch.arange(LENGTH)[None, :] < torch.tensor(lengths)[:, None]).double()
    return log_prob, old, advantages, mask


def core(method, log_prob, old, advantages, mask, **params):
    """(loss, gradient w.r.t. log_prob, metrics) of bapo.core at the method's own aggregation."""
    leaf = log_prob.clone().requires_grad_()
    loss, metrics = policy_loss(leaf, old, advantages, mask, method, **params)
    loss.backward()
    return float(loss.detach()), leaf.grad, metrics


def as_lists(log_prob, old, advantages, mask):
    return log_prob.tolist(), old.tolist(), advantages.tolist(), mask.tolist()


def check(method, reference, seed, spread=0.3, params=None, ref_params=None):
    tensors = random_batch(seed, spread)
    loss, grad, metrics = core(method, *tensors, **(params or {}))
    expected_loss, expected_grad, *rest = reference(*as_lists(*tensors), **(ref_params or params or {}))
    assert loss == pytest.approx(expected_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    return metrics, rest


# --- (a) against the formula, token by token ----------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spread", [1e-4, 0.3])
def test_gspo_matches_its_formula(seed, spread):
    metrics, _ = check("gspo", ref.gspo, seed, spread)
    assert PAPER_AGG_MODES["gspo"] == "seq-mean-token-mean"
    assert (metrics["lower"], metrics["upper"]) == (1 - 3e-4, 1 + 4e-4)


def test_gspo_clips_whole_sequences_by_the_sequence_ratio():
    # one sequence, token ratios 2 and 0.5: s = 1, nothing clipped though each token ratio is far out
    log_prob = torch.tensor([[math.log(2.0), math.log(0.5)], [0.3, 0.3]], dtype=torch.float64)
    loss, grad, metrics = core("gspo", log_prob, torch.zeros_like(log_prob), torch.tensor([1.0, 1.0]), torch.ones(2, 2))
    assert grad[0].tolist() == pytest.approx([-0.25, -0.25]) and grad[1].tolist() == [0.0, 0.0]
    assert metrics["clip_frac/upper"] == 0.5  # the second sequence (s = e^0.3), both its tokens


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "method, params", [("cispo", {}), ("cispo-verl", {"lower": 0.8, "upper": 1.2}), ("cispo", {"upper": 1.1})]
)
def test_cispo_matches_its_formula(seed, method, params):
    ref_params = {"lower": None, "upper": 5.0, **params}
    metrics, _ = check(method, ref.cispo, seed, 0.5, params, ref_params)
    assert metrics["clip_frac"] == 0.0 and metrics["upper"] == math.inf  # no token loses its gradient


@pytest.mark.parametrize("seed", range(4))
def test_sapo_matches_its_formula(seed):
    check("sapo", ref.sapo, seed, 0.5)
    check("sapo", ref.sapo, seed, 0.5, {"tau_pos": 2.0, "tau_neg": 3.0})


@pytest.mark.parametrize("seed", range(4))
def test_gmpo_matches_its_formula(seed):
    metrics, _ = check("gmpo", ref.gmpo, seed, 0.5)
    check("gmpo", ref.gmpo, seed, 0.5, {"lower": 0.8, "upper": 1.2})
    assert metrics["lower"] == pytest.approx(math.exp(-0.4)) and metrics["upper"] == pytest.approx(math.exp(0.4))


@pytest.mark.parametrize("seed", range(4))
def test_clip_cov_with_every_candidate_drawn_matches_its_formula(seed):
    tensors = random_batch(seed, 0.5)
    params = {"cov_fraction": 1.0, "cov_lower": 0.05, "cov_upper": 5.0}
    loss, grad, metrics = core("clip-cov", *tensors, **params)
    expected_loss, expected_grad, dropped = ref.clip_cov_all(*as_lists(*tensors), cov_lower=0.05)
    assert dropped and loss == pytest.approx(expected_loss, rel=1e-9)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert metrics["clip_frac/dropped"] == pytest.approx(len(dropped) / float(tensors[3].sum()))


def test_clip_cov_draws_max_of_fraction_and_one_among_the_candidates():
    tensors = random_batch(1, 0.5)
    *_, candidates = ref.clip_cov_all(*as_lists(*tensors), cov_lower=0.05)
    tokens = float(tensors[3].sum())
    for fraction, expected in ((1e-4, 1), (0.1, int(0.1 * tokens))):
        _, grad, metrics = core("clip-cov", *tensors, cov_fraction=fraction, cov_lower=0.05)
        assert metrics["clip_frac/dropped"] * tokens == pytest.approx(expected)
        _, full_grad, _ = core("clip-cov", *tensors, cov_fraction=1e-9, cov_lower=100.0, cov_upper=101.0)
        zeroed = {(i, t) for i, t in zip(*torch.nonzero((grad == 0) & (full_grad != 0), as_tuple=True))}
        assert {(int(i), int(t)) for i, t in zeroed} <= candidates


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fraction", [2e-4, 0.2])
def test_kl_cov_matches_its_formula(seed, fraction):
    metrics, (penalized,) = check(
        "kl-cov", ref.kl_cov, seed, 0.5, {"cov_fraction": fraction}, {"cov_fraction": fraction}
    )
    assert metrics["kl_cov/penalized_frac"] == pytest.approx(len(penalized) / 26)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("spread, budget", [(0.1, 0.04), (0.3, 0.04), (0.5, 0.01), (2.0, 1e-6)])
def test_m2po_matches_algorithm_1(seed, spread, budget):
    metrics, (dropped,) = check("m2po", ref.m2po, seed, spread, {"budget": budget})
    assert metrics["clip_frac/dropped"] == pytest.approx(len(dropped) / 26)
    assert metrics["m2po/m2_kept"] <= budget or len(dropped) == 26


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("spread, budget", [(0.05, 0.04), (0.3, 0.04), (0.6, 0.04), (0.5, 0.2)])
def test_m2po_official_bounds_and_loss_match_its_loop(seed, spread, budget):
    tensors = random_batch(seed, spread)
    lower, upper = ref.m2po_official_bounds(*as_lists(*tensors), budget=budget)
    loss, grad, metrics = core("m2po-official", *tensors, budget=budget)
    assert (metrics["lower"], metrics["upper"]) == (pytest.approx(lower, rel=1e-9), pytest.approx(upper, rel=1e-9))
    expected, expected_grad, _ = core("grpo", *tensors, lower=lower, upper=upper)
    assert loss == pytest.approx(expected, rel=1e-9)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


def probability_batch(seed: int, spread: float = 0.5):
    """random_batch with every log-prob below 0 (a probability < 1: DPPO reads p = exp(log pi))."""
    log_prob, old, advantages, mask = random_batch(seed, spread)
    return log_prob.clamp(max=-1e-3), old, advantages, mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "method, params",
    [
        ("dppo-tv", {}),
        ("dppo-tv", {"delta_low": 0.05, "delta_high": 0.3, "ratio_cap": 1.5}),
        ("dppo-kl", {}),
        ("dppo-kl", {"delta_low": 0.01, "delta_high": 0.2, "ratio_cap": 2.0}),
    ],
)
def test_dppo_matches_its_formula(seed, method, params):
    tensors = probability_batch(seed)
    loss, grad, metrics = core(method, *tensors, **params)
    divergence = method.removeprefix("dppo-")
    expected, expected_grad = ref.dppo(*as_lists(*tensors), divergence=divergence, **params)
    assert PAPER_AGG_MODES[method] == "seq-mean-token-sum-norm"
    assert loss == pytest.approx(expected, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    log_prob, old, advantages, mask = as_lists(*tensors)
    outside = sum(
        1
        for i in range(BATCH)
        for t in range(LENGTH)
        if mask[i][t]
        and not ref._dppo_keep(
            math.exp(log_prob[i][t]),
            math.exp(old[i][t]),
            advantages[i],
            divergence,
            params.get("delta_low", 0.15 if divergence == "tv" else 0.05),
            params.get("delta_high", 0.15 if divergence == "tv" else 0.05),
        )
    )
    assert 0 < outside < 26  # the batch has tokens on both sides of the trust region
    assert metrics["clip_frac/dropped"] == pytest.approx(outside / 26)
    assert (metrics["lower"], metrics["upper"]) == (0.0, math.inf)


def test_dppo_masks_by_probability_change_not_by_ratio():
    """The paper's example: a rare positive token 1e-4 -> 1e-2 (ratio 100, far outside PPO's
    [0.8, 1.2]) stays inside the TV region (change 0.0099 <= 0.15) and keeps its gradient; a
    common negative one 0.99 -> 0.8 (ratio 0.81, inside PPO's bounds) leaves it (change 0.19)."""
    log_prob = torch.tensor([[math.log(1e-2), math.log(0.8)]], dtype=torch.float64)
    old = torch.tensor([[math.log(1e-4), math.log(0.99)]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    _, grad, metrics = core("dppo-tv", log_prob, old, advantages, mask, loss_agg_mode="token-mean")
    assert grad[0, 0] == pytest.approx(-100.0 / 2) and grad[0, 1] == 0
    assert metrics["clip_frac/dropped"] == pytest.approx(1 / 2)
    _, capped, metrics = core("dppo-tv", log_prob, old, advantages, mask, loss_agg_mode="token-mean", ratio_cap=20.0)
    assert capped[0, 0] == pytest.approx(-20.0 / 2) and metrics["dppo/truncated_frac"] == pytest.approx(1 / 2)
    _, ppo, _ = core("grpo", log_prob, old, advantages, mask)
    assert ppo[0, 0] == 0 and ppo[0, 1] != 0  # PPO's ratio clip does the opposite


# --- (b) against verl's own functions ---------------------------------------------------------


def verl_loss(name: str, tensors, agg_mode: str, **config):
    """(loss, gradient) of verl's registered policy loss `name` on the same tensors."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy = {k: config.pop(k) for k in list(config) if k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")}
    policy |= {k: config.pop(k) for k in list(config) if k in ("kl_cov_ratio", "ppo_kl_coef")}
    actor = ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=4,
        loss_agg_mode=agg_mode,
        policy_loss=PolicyLossConfig(loss_mode=name, **policy),
        **config,
    )
    log_prob, old, advantages, mask = tensors
    leaf = log_prob.clone().requires_grad_()
    loss, _ = core_algos.get_policy_loss_fn(name)(
        old, leaf, advantages[:, None].expand_as(leaf), mask, loss_agg_mode=agg_mode, config=actor
    )
    loss.backward()
    return float(loss.detach()), leaf.grad


VERL_CASES = [
    # (bapo method, its params, verl loss, verl actor settings, aggregation)
    ("gspo", {}, "gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, "seq-mean-token-mean"),
    ("gspo", {"lower": 0.9, "upper": 1.05}, "gspo", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.05}, "token-mean"),
    ("cispo-verl", {}, "cispo", {}, "token-mean"),
    (
        "cispo-verl",
        {"lower": 0.7, "upper": 1.1},
        "cispo",
        {"clip_ratio_low": 0.3, "clip_ratio_high": 0.1},
        "token-mean",
    ),
    ("sapo", {}, "sapo", {}, "seq-mean-token-mean"),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 4.0}, "sapo", {"tau_pos": 2.0, "tau_neg": 4.0}, "seq-mean-token-mean"),
    ("gmpo", {}, "geo_mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, "seq-mean-token-mean"),
    (
        "gmpo",
        {"lower": math.exp(-0.2), "upper": math.exp(0.3)},
        "geo_mean",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3},
        "seq-mean-token-mean",
    ),
    ("kl-cov", {}, "kl_cov", {}, "token-mean"),
    (
        "kl-cov",
        {"cov_fraction": 0.2, "kl_coef": 1.0},
        "kl_cov",
        {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0},
        "token-mean",
    ),
    ("clip-cov", {"cov_lower": 0.05}, "clip_cov", {"clip_cov_lb": 0.05}, "token-mean"),
    (
        "clip-cov",
        {"cov_fraction": 0.2, "cov_lower": 0.02, "cov_upper": 0.5},
        "clip_cov",
        {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.02, "clip_cov_ub": 0.5},
        "token-mean",
    ),
]


def _dppo_case(method: str, params: dict, agg_mode: str) -> tuple:
    """verl's dppo_tv / dppo_kl read the divergence thresholds from clip_ratio_low / _high and the
    ratio cap from clip_ratio_c (its example of the paper's runs: 10000, i.e. core's ratio_cap=None)."""
    default = 0.15 if method == "dppo-tv" else 0.05
    verl_config = {
        "clip_ratio_low": params.get("delta_low", default),
        "clip_ratio_high": params.get("delta_high", default),
        "clip_ratio_c": params.get("ratio_cap") or 1e4,
    }
    return method, params, method.replace("-", "_"), verl_config, agg_mode


VERL_CASES += [
    _dppo_case("dppo-tv", {}, "token-mean"),
    _dppo_case("dppo-tv", {"delta_low": 0.05, "delta_high": 0.3, "ratio_cap": 1.5}, "seq-mean-token-sum-norm"),
    _dppo_case("dppo-kl", {}, "token-mean"),
    _dppo_case("dppo-kl", {"delta_low": 0.01, "delta_high": 0.2, "ratio_cap": 2.0}, "seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.verl
@pytest.mark.parametrize("method, params, verl_name, verl_config, agg_mode", VERL_CASES)
def test_equals_verls_own_function(seed, method, params, verl_name, verl_config, agg_mode):
    tensors = probability_batch(seed) if method.startswith("dppo") else random_batch(seed, 0.5)
    torch.manual_seed(seed)  # clip_cov draws with torch's global generator, as verl does
    loss, grad, _ = core(method, *tensors, loss_agg_mode=agg_mode, **params)
    torch.manual_seed(seed)
    expected, expected_grad = verl_loss(verl_name, tensors, agg_mode, **dict(verl_config))
    assert loss == pytest.approx(expected, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-9)


# --- diagnostics --------------------------------------------------------------------------------


def test_dropped_tokens_count_once_and_carry_no_share():
    log_prob = torch.tensor([[0.0, 2.0, -2.0, 0.05]], dtype=torch.float64)  # (log r)^2: 0, 4, 4, 0.0025
    loss, grad, metrics = core("m2po", log_prob, torch.zeros_like(log_prob), torch.tensor([1.0]), torch.ones(1, 4))
    assert grad[0, 1] == 0 and grad[0, 2] == 0 and grad[0, 0] != 0
    assert metrics["clip_frac/dropped"] == 0.5 and metrics["clip_frac"] == 0.5 and metrics["clip_frac/upper"] == 0.0
    assert metrics["m2po/m2"] == pytest.approx(8.0025 / 4) and metrics["m2po/m2_kept"] == pytest.approx(0.0025 / 2)


# --- (b) against TRL's GRPOTrainer._compute_loss ------------------------------------------------


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(
    tensors,
    loss_type: str,
    level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    off_policy_mask_threshold: float | None = None,
    **args,
):
    """(loss, gradient) of TRL's own GRPOTrainer._compute_loss on the same tensors: the trainer's
    state is a stub and its forward returns our log-probs, so what runs is TRL's loss code."""
    import types
    from collections import defaultdict

    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    log_prob, old, advantages, mask = tensors
    leaf = log_prob.clone().requires_grad_()
    stub = types.SimpleNamespace(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        beta=0.0,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=off_policy_mask_threshold,
        get_off_policy_mask=grpo.GRPOTrainer.get_off_policy_mask,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1, **args),
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
    )
    length = mask.shape[1]
    inputs = {
        "prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long),
        "prompt_mask": torch.ones(len(mask), 1, dtype=torch.long),
        "completion_ids": torch.zeros(len(mask), length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    loss = grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return float(loss.detach()), leaf.grad


TRL_CASES = [
    # (bapo method, its params, TRL loss_type, TRL settings)
    ("cispo", {}, "cispo", {"epsilon_high": 5.0}),
    ("cispo", {"upper": 1.3}, "cispo", {"epsilon_high": 1.3}),
    ("sapo", {}, "sapo", {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 3.0}, "sapo", {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 3.0}),
    # TRL's GSPO: loss_type="grpo" (seq-mean-token-mean) with importance_sampling_level="sequence"
    ("gspo", {}, "grpo", {"level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
    ("gspo", {"lower": 0.9, "upper": 1.05}, "grpo", {"level": "sequence", "epsilon": 0.1, "epsilon_high": 0.05}),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("method, params, loss_type, settings", TRL_CASES)
def test_equals_trls_own_loss(seed, method, params, loss_type, settings):
    tensors = random_batch(seed, 0.5)
    loss, grad, _ = core(method, *tensors, **params)
    expected, expected_grad = trl_loss(tensors, loss_type, **settings)
    assert loss == pytest.approx(expected, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-9)


# --- off-policy sequence masking (OPSM) against TRL's ------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("threshold", [0.02, 0.1, 0.5])
def test_off_policy_sequence_mask_equals_trls(seed, threshold):
    """bapo.core.off_policy_sequence_mask against TRL's GRPOTrainer.get_off_policy_mask: the same
    keep decision per response (1/|y| sum (log mu - log pi) > delta with A < 0 drops it)."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    log_prob, old, advantages, mask = random_batch(seed, 0.5)
    keep = off_policy_sequence_mask(log_prob, old, advantages, mask, threshold)
    expected = grpo.GRPOTrainer.get_off_policy_mask(advantages[:, None], log_prob, old, mask, threshold)
    torch.testing.assert_close(keep, (expected * mask).to(keep.dtype))
    dropped = (keep.sum(-1) == 0) & (mask.sum(-1) > 0)
    assert bool((advantages[dropped] < 0).all())


def test_off_policy_sequence_mask_follows_the_formula():
    # mean log(mu / pi) per response: 0.3, 0.3 (positive advantage: kept anyway), 0.05; padding ignored
    sampling = torch.tensor([[0.0, 0.0, -9.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    log_prob = torch.tensor([[-0.2, -0.4, 5.0], [-0.3, -0.3, -0.3], [-0.05, -0.05, -0.05]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    keep = off_policy_sequence_mask(log_prob, sampling, torch.tensor([-1.0, 1.0, -1.0]), mask, 0.1)
    assert keep.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="^threshold"):
        off_policy_sequence_mask(log_prob, sampling, torch.ones(3), mask, 0.0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("method, params, loss_type, settings", [TRL_CASES[i] for i in (0, 2, 4)])
def test_opsm_as_token_weights_equals_trls_masked_loss(seed, method, params, loss_type, settings):
    """TRL multiplies its per-token loss by the mask; bapo passes it as importance weights, which
    policy_loss multiplies into the token loss: the same loss and gradient."""
    tensors = random_batch(seed, 0.5)
    log_prob, old, advantages, mask = tensors
    keep = off_policy_sequence_mask(log_prob, old, advantages, mask, 0.1)
    assert 0 < float(keep.sum()) < float(mask.sum())  # the mask drops some responses here
    loss, grad, _ = core(method, *tensors, importance_weights=keep, **params)
    expected, expected_grad = trl_loss(tensors, loss_type, off_policy_mask_threshold=0.1, **settings)
    assert loss == pytest.approx(expected, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-9)


# --- decoupled PPO ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("params", [{}, {"weight_cap": 1.3}, {"lower": 0.7, "upper": 1.5}])
def test_decoupled_ppo_matches_its_formula(seed, params):
    tensors = random_batch(seed, 0.5)
    log_prob, old = tensors[0], tensors[1]
    proximal = old + 0.6 * (log_prob - old)  # between the behaviour and the current policy
    loss, grad, metrics = core("decoupled-ppo", *tensors, proximal_log_prob=proximal, **params)
    expected, expected_grad = ref.decoupled_ppo(*as_lists(*tensors), proximal.tolist(), **params)
    assert loss == pytest.approx(expected, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    capped = float(((proximal - old).exp() > 1.3)[tensors[3].bool()].double().mean())
    assert metrics["clip_frac/dropped"] == (pytest.approx(capped) if params.get("weight_cap") else 0.0)


def test_decoupled_ppo_with_the_proximal_at_the_behaviour_is_grpo():
    tensors = random_batch(0, 0.5)
    decoupled, grad, _ = core("decoupled-ppo", *tensors, proximal_log_prob=tensors[1])
    grpo, grpo_grad, _ = core("grpo", *tensors)
    assert decoupled == pytest.approx(grpo) and torch.allclose(grad, grpo_grad)


def test_proximal_log_probs_are_required_by_decoupled_ppo_and_refused_elsewhere():
    tensors = random_batch(0)
    with pytest.raises(ValueError, match="^proximal_log_prob: method 'decoupled-ppo' needs"):
        policy_loss(*tensors, "decoupled-ppo")
    with pytest.raises(ValueError, match="^proximal_log_prob: method 'grpo' does not read it"):
        policy_loss(*tensors, "grpo", proximal_log_prob=tensors[1])
    bad = tensors[1].clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="^proximal_log_prob: "):
        policy_loss(*tensors, "decoupled-ppo", proximal_log_prob=bad)
