"""bapo's losses registered in verl: same values and gradients as bapo.core, verl's normalisation."""

import dataclasses
import math

import pytest
import torch

pytest.importorskip("verl")

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, compute_policy_loss_vanilla  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import bapo.integrations.verl  # noqa: E402,F401  (registers the losses)
from bapo.core import (  # noqa: E402
    BAPOConfig,
    BAPOStep,
    SearchResult,
    TokenBatch,
    aggregate_loss,
    policy_loss,
    positive_share,
    search_bounds,
)
from bapo.integrations.verl import BAPOPolicyLossConfig, core_aggregation  # noqa: E402

pytestmark = pytest.mark.verl  # runs in .venv-verl (make test)


VERL_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# One micro-batch of a bigger update on 2 ranks (what verl's ppo_loss writes), and a lone batch.
GLOBAL_INFOS = (
    {},
    {"dp_size": 2, "batch_num_tokens": 41, "global_batch_size": 12, "loss_scale_factor": None},
    {"dp_size": 2, "batch_num_tokens": 41, "global_batch_size": 12, "loss_scale_factor": 32},
)
BATCH, LENGTH = 6, 9


def make_tokens(seed: int = 0) -> dict[str, torch.Tensor]:
    """One micro-batch [BATCH, LENGTH]: ratios spread over ~[0.4, 2.7], one fully masked row."""
    generator = torch.Generator().manual_seed(seed)
    old_log_prob = -torch.rand(BATCH, LENGTH, generator=generator) * 3.0
    log_prob = old_log_prob + torch.randn(BATCH, LENGTH, generator=generator) * 0.5
    lengths = torch.tensor([9, 7, 5, 3, 8, 0])
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
    advantages = torch.randn(BATCH, 1, generator=generator).expand(BATCH, LENGTH).contiguous()
    weights = torch.rand(BATCH, LENGTH, generator=generator) * 0.5 + 0.75
    return {
        "old_log_prob": old_log_prob,
        "log_prob": log_prob,
        "advantages": advantages,
        "response_mask": mask,
        "rollout_is_weights": weights,
    }


def actor_config(mode: str, policy_loss_config: PolicyLossConfig, global_info: dict) -> ActorConfig:
    config = ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=4,
        loss_agg_mode=mode,
        policy_loss=policy_loss_config,
    )
    config.global_batch_info.update(global_info)
    return config


def expected_normalizer(mode: str, mask: torch.Tensor, info: dict) -> float:
    """verl's agg_loss denominators written out by hand, divided by dp_size (bapo.core's normalizer)."""
    dp = info.get("dp_size", 1)
    tokens = info.get("batch_num_tokens") or float(mask.sum())
    sequences = info.get("global_batch_size") or float((mask.sum(-1) > 0).sum())
    return {
        "token-mean": tokens / dp,
        "token-sum": 1.0 / dp,
        "seq-mean-token-sum": sequences / dp,
        "seq-mean-token-mean": sequences / dp,
        "seq-mean-token-sum-norm": sequences * (info.get("loss_scale_factor") or mask.shape[-1]) / dp,
    }[mode]


def in_step(
    policy_loss_config: BAPOPolicyLossConfig, solved: SearchResult | None = None, tokens: int = 0, target=None
) -> BAPOPolicyLossConfig:
    """`policy_loss_config` with a BAPOStep attached in the middle of an optimizer update, as
    BAPOTrainingWorker leaves it for the loss: `solved` adopted as the step's bounds (scope step,
    `tokens` seen by its search); target: the controller's rho0 of this step."""
    step = BAPOStep(policy_loss_config.bapo_config())
    if target is not None:
        step.controller.target = target
    step.begin()
    if solved is not None:
        step.adopt(solved, tokens)
    policy_loss_config.attach_step(step)
    return policy_loss_config


def run_registered(method: str, mode: str, config: ActorConfig, tokens: dict, weighted: bool):
    log_prob = tokens["log_prob"].clone().requires_grad_(True)
    loss, metrics = POLICY_LOSS_REGISTRY[method](
        old_log_prob=tokens["old_log_prob"],
        log_prob=log_prob,
        advantages=tokens["advantages"],
        response_mask=tokens["response_mask"],
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=tokens["rollout_is_weights"] if weighted else None,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


def run_core(method: str, mode: str, info: dict, tokens: dict, weighted: bool, **params):
    log_prob = tokens["log_prob"].clone().requires_grad_(True)
    core_mode = "token-mean" if mode == "token-sum" else mode
    loss, _ = policy_loss(
        log_prob,
        tokens["old_log_prob"],
        tokens["advantages"],
        tokens["response_mask"],
        method,
        loss_agg_mode=core_mode,
        normalizer=expected_normalizer(mode, tokens["response_mask"], info),
        importance_weights=tokens["rollout_is_weights"] if weighted else None,
        **params,
    )
    loss.backward()
    return loss.detach(), log_prob.grad


def test_import_registers_bapo_topr_dcpo_and_m2po():
    for method in ("bapo", "topr", "dcpo", "m2po", "m2po-official"):
        assert POLICY_LOSS_REGISTRY[method].__module__ == "bapo.integrations.verl.losses"


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("info", GLOBAL_INFOS)
def test_core_aggregation_reproduces_verl_agg_loss(mode, info):
    tokens = make_tokens()
    loss_mat = torch.randn(BATCH, LENGTH)
    mask = tokens["response_mask"]
    core_mode, normalizer = core_aggregation(mode, mask, **info)
    torch.testing.assert_close(
        aggregate_loss(loss_mat, mask, core_mode, normalizer),
        agg_loss(loss_mat, mask, mode, **info),
        rtol=1e-6,
        atol=1e-7,
    )


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("info", GLOBAL_INFOS[:2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(
    ("method", "loss_config", "core_params"),
    [
        ("bapo", {"target": 0.5}, {"bounds": (0.7, 1.6), "dual_clip": 3.0}),  # verl's clip_ratio_c default
        ("topr", {"negative_ratio_max": 1.5}, {"negative_ratio_max": 1.5}),
        ("dcpo", {"eps_low": 0.1, "eps_high": 0.3}, {"eps_low": 0.1, "eps_high": 0.3, "dual_clip": 3.0}),
        ("m2po", {"budget": 0.01}, {"budget": 0.01}),  # verl lacks M2PO: bapo registers both variants
        ("m2po-official", {}, {}),
    ],
)
def test_registered_loss_equals_core(method, loss_config, core_params, mode, info, weighted):
    tokens = make_tokens(seed=1)
    policy_loss_config = BAPOPolicyLossConfig(loss_mode=method, **loss_config)
    # bounds as BAPOTrainingWorker hands them to the step
    solved = SearchResult(lower=0.7, upper=1.6, positive_share=0.55, reached=True, steps=9)
    config = actor_config(mode, in_step(policy_loss_config, solved, tokens=10), info)
    loss, grad, _ = run_registered(method, mode, config, tokens, weighted)
    expected_loss, expected_grad = run_core(method, mode, info, tokens, weighted, **core_params)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("clip_ratio_c", [3.0, 1.5, 1e9])
def test_bapo_with_ppo_bounds_equals_verl_vanilla(mode, weighted, clip_ratio_c):
    """bapo at bounds (0.8, 1.2) is verl's own PPO loss with eps 0.2, dual-clip at the actor's
    clip_ratio_c included (1.5 caps some of these tokens; 1e9 is off), every mode."""
    tokens = make_tokens(seed=2)
    info = GLOBAL_INFOS[1]
    bapo_config = BAPOPolicyLossConfig(loss_mode="bapo")
    solved = SearchResult(lower=0.8, upper=1.2, positive_share=0.5, reached=True, steps=0)
    config = actor_config(mode, in_step(bapo_config, solved), info)
    object.__setattr__(config, "clip_ratio_c", clip_ratio_c)
    loss, grad, metrics = run_registered("bapo", mode, config, tokens, weighted)

    vanilla = actor_config(mode, PolicyLossConfig(), info)
    object.__setattr__(vanilla, "clip_ratio_c", clip_ratio_c)
    log_prob = tokens["log_prob"].clone().requires_grad_(True)
    expected, vanilla_metrics = compute_policy_loss_vanilla(
        tokens["old_log_prob"],
        log_prob,
        tokens["advantages"],
        tokens["response_mask"],
        mode,
        vanilla,
        tokens["rollout_is_weights"] if weighted else None,
    )
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, log_prob.grad, rtol=1e-5, atol=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(
        float(vanilla_metrics["actor/pg_clipfrac_lower"]), abs=1e-6
    )
    if clip_ratio_c == 1.5:
        assert metrics["actor/pg_clipfrac_lower"] > 0 and metrics["actor/bapo/clip_frac/dual"] > 0


def test_metrics_use_verl_names_and_the_solved_bounds():
    tokens = make_tokens(seed=3)
    policy_loss_config = BAPOPolicyLossConfig(loss_mode="bapo")
    solved = SearchResult(lower=0.66, upper=1.85, positive_share=0.52, reached=True, steps=13, pos_neg=0.52 / 0.48)
    config = actor_config("token-mean", in_step(policy_loss_config, solved, tokens=40), {})
    _, _, metrics = run_registered("bapo", "token-mean", config, tokens, True)
    assert metrics["actor/bapo/lower"] == 0.66 and metrics["actor/bapo/upper"] == 1.85
    assert metrics["actor/bapo/search/share"] == 0.52 and metrics["actor/bapo/search/steps"] == 13.0
    assert metrics["actor/bapo/search/tokens"] == 40.0 and metrics["actor/bapo/search/scope"] == 0.0
    assert metrics["actor/bapo/search/pos_neg"] == pytest.approx(0.52 / 0.48)
    for key in (
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/bapo/clip_frac/upper",
        "actor/bapo/clip_frac/lower",
        "actor/bapo/approx_kl",
        "actor/bapo/quadrant/low_pos/clip_frac",
    ):
        assert math.isfinite(metrics[key]), key
    assert metrics["actor/pg_clipfrac_lower"] >= 0  # verl's name: the dual-clip fraction of all tokens
    assert all(isinstance(value, float) for value in metrics.values())


@pytest.mark.parametrize("weighted", [False, True])
def test_micro_batch_scope_searches_this_micro_batch(weighted):
    """scope micro_batch: the loss solves bounds on its own micro-batch (weighted as in the loss)."""
    tokens = make_tokens(seed=4)
    policy_loss_config = BAPOPolicyLossConfig(loss_mode="bapo", target=0.6, scope="micro_batch")
    config = actor_config("token-mean", in_step(policy_loss_config), {})
    loss, grad, metrics = run_registered("bapo", "token-mean", config, tokens, weighted)
    found = search_bounds(
        TokenBatch.from_log_probs(
            tokens["log_prob"],
            tokens["old_log_prob"],
            tokens["advantages"],
            tokens["response_mask"].bool(),
            importance_weights=tokens["rollout_is_weights"] if weighted else None,
        ),
        policy_loss_config.bapo_config(),
    )
    assert (metrics["actor/bapo/search/lower"], metrics["actor/bapo/search/upper"]) == (found.lower, found.upper)
    assert metrics["actor/bapo/search/scope"] == 1.0
    expected_loss, expected_grad = run_core(
        "bapo", "token-mean", {}, tokens, weighted, bounds=(found.lower, found.upper)
    )
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)


def test_micro_batch_scope_searches_with_the_step_config_and_logs_its_target():
    """The worker's controller sets rho0 per step (BAPOStep.search_config): the micro-batch search
    and actor/bapo/target use it, not the policy_loss config's own target."""
    tokens = make_tokens(seed=4)
    policy_loss_config = BAPOPolicyLossConfig(loss_mode="bapo", target=0.3, scope="micro_batch", target_mode="entropy")
    step_config = dataclasses.replace(policy_loss_config.bapo_config(), target=0.75)
    config = actor_config("token-mean", in_step(policy_loss_config, target=0.75), {})
    _, _, metrics = run_registered("bapo", "token-mean", config, tokens, False)
    batch = TokenBatch.from_log_probs(
        tokens["log_prob"], tokens["old_log_prob"], tokens["advantages"], tokens["response_mask"].bool()
    )
    found = search_bounds(batch, step_config)
    assert (metrics["actor/bapo/search/lower"], metrics["actor/bapo/search/upper"]) == (found.lower, found.upper)
    own = search_bounds(batch, policy_loss_config.bapo_config())
    assert (own.lower, own.upper) != (found.lower, found.upper)  # the step's rho0 mattered
    assert metrics["actor/bapo/target"] == 0.75


def test_entropy_target_without_bapo_worker_fails_naming_the_setting():
    """No BAPOTrainingWorker (no BAPOStep attached): nothing feeds the controller, so refuse, not run fixed."""
    config = actor_config("token-mean", BAPOPolicyLossConfig(loss_mode="bapo", target_mode="entropy"), {})
    with pytest.raises(ValueError, match="target_mode.*BAPOTrainingWorker"):
        run_registered("bapo", "token-mean", config, make_tokens(), False)


def test_topr_leaves_out_its_unbounded_upper():
    _, _, metrics = run_registered(
        "topr",
        "token-mean",
        actor_config("token-mean", BAPOPolicyLossConfig(loss_mode="topr"), {}),
        make_tokens(),
        False,
    )
    assert "actor/bapo/upper" not in metrics and all(
        math.isfinite(v) for k, v in metrics.items() if "/premise/" not in k
    )  # premise: NaN when a group is empty


def test_plain_policy_loss_config_searches_per_micro_batch():
    """loss_mode=bapo without BAPOPolicyLossConfig still works: core's search on this micro-batch alone."""
    tokens = make_tokens(seed=4)
    config = actor_config("token-mean", PolicyLossConfig(loss_mode="bapo"), {})
    loss, grad, metrics = run_registered("bapo", "token-mean", config, tokens, False)
    found = search_bounds(
        TokenBatch.from_log_probs(
            tokens["log_prob"], tokens["old_log_prob"], tokens["advantages"], tokens["response_mask"].bool()
        ),
        BAPOConfig(),
    )
    assert (metrics["actor/bapo/search/lower"], metrics["actor/bapo/search/upper"]) == (found.lower, found.upper)
    expected_loss, expected_grad = run_core("bapo", "token-mean", {}, tokens, False, bounds=found, dual_clip=3.0)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)


def test_config_rejects_a_bad_search_space():
    with pytest.raises(ValueError, match="lower"):
        BAPOPolicyLossConfig(lower_start=0.95, lower_max=0.9)


def test_distillation_config_without_policy_loss_fails_naming_the_setting():
    """verl's distillation path passes its DistillationLossConfig (no policy_loss) as config."""
    from verl.workers.config.distillation import DistillationLossConfig

    config = DistillationLossConfig(use_policy_gradient=True, loss_mode="k1")
    config.global_batch_info.update({})
    tokens = make_tokens()
    with pytest.raises(ValueError, match="policy_loss_mode.*actor_rollout_ref.actor.policy_loss"):
        run_registered("bapo", "token-mean", config, tokens, False)
    for method in ("topr", "dcpo"):  # no bapo search: core's defaults, dual-clip 3.0 as vanilla
        loss, grad, metrics = run_registered(method, "token-mean", config, tokens, False)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("method", ["bapo", "topr"])
def test_every_registered_loss_logs_lengths_by_advantage_sign_and_the_share_at_the_start_bounds(method):
    """verl's loss sees advantages, not rewards: a response is "rewarded" when its advantage is > 0.
    The share at the start bounds uses the policy_loss config's (here 0.7, 1.3) and the IS weights."""
    tokens = make_tokens(seed=6)
    policy_loss_config = BAPOPolicyLossConfig(loss_mode=method, lower_start=0.7, upper_start=1.3)
    if method == "bapo":  # the step's bounds: these (the share at the start bounds does not depend on them)
        solved = SearchResult(lower=0.8, upper=2.0, positive_share=0.5, reached=True, steps=9, pos_neg=1.0)
        policy_loss_config = in_step(policy_loss_config, solved, tokens=40)
    config = actor_config("token-mean", policy_loss_config, {})
    _, _, metrics = run_registered(method, "token-mean", config, tokens, True)
    mask, advantage = tokens["response_mask"], tokens["advantages"][:, 0]
    lengths = mask.sum(1).double()
    rewarded = (advantage > 0) & (lengths > 0)  # the empty row has no tokens: its masked advantage sum is 0
    assert metrics["actor/bapo/response_length/rewarded"] == pytest.approx(float(lengths[rewarded].mean()))
    assert metrics["actor/bapo/response_length/unrewarded"] == pytest.approx(float(lengths[~rewarded].mean()))
    expected = positive_share(
        TokenBatch.from_log_probs(
            tokens["log_prob"],
            tokens["old_log_prob"],
            tokens["advantages"],
            mask,
            importance_weights=tokens["rollout_is_weights"],
        ),
        0.7,
        1.3,
        policy_loss_config.bapo_config(),
    )
    # the same float32 ratio and float64 sums on both sides
    assert metrics["actor/bapo/positive_share/start_bounds"] == pytest.approx(expected, rel=1e-12)
    # the sums verl averages over micro-batches: their ratio is the mini-batch's length exactly
    ratio_of_sums = metrics["actor/bapo/balance/rewarded_tokens"] / metrics["actor/bapo/balance/rewarded_responses"]
    assert ratio_of_sums == pytest.approx(metrics["actor/bapo/response_length/rewarded"])
