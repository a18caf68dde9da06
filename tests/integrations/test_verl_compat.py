"""bapo's verl losses against the verl API they were written for: the installed verl passes, a verl
whose `compute_policy_loss_vanilla` arguments changed fails at import with both versions named,
and the registered losses take exactly the arguments verl's own loss takes (by keyword, as ppo_loss)."""

import inspect

import pytest
import torch

pytest.importorskip("verl")

from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn

import bapo.integrations.verl  # noqa: F401  (registers the losses)
from bapo.integrations.verl import VERL_LOSSES
from bapo.integrations.verl.compat import (
    POLICY_LOSS_ARGS,
    SUPPORTED,
    WRITTEN_FOR,
    VerlVersionError,
    check_verl_api,
    installed_verl_version,
)

pytestmark = pytest.mark.verl  # runs in .venv-verl (make test)


def test_installed_verl_matches_the_api_bapo_was_written_for():
    check_verl_api()
    assert tuple(inspect.signature(compute_policy_loss_vanilla).parameters) == POLICY_LOSS_ARGS


def test_pin_covers_the_version_written_for():
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    verl_pin = [r for r in extras["project"]["optional-dependencies"]["verl"] if r.startswith("verl")]
    assert verl_pin == [f"verl{SUPPORTED}"] and WRITTEN_FOR.startswith("0.9.")


def with_extra_entropy(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    config=None,
    rollout_is_weights=None,
    entropy=None,
):
    """A future verl passing one more argument."""


def without_weights(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
    """An older verl without rollout_is_weights."""


def swapped(
    log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """The same names in another order."""


@pytest.mark.parametrize(
    "reference, expected",
    [
        (with_extra_entropy, "new \\['entropy'\\]"),
        (without_weights, "missing \\['rollout_is_weights'\\]"),
        (swapped, "reordered"),
    ],
)
def test_a_changed_verl_signature_fails_loudly_naming_the_versions(reference, expected):
    with pytest.raises(VerlVersionError, match=expected) as err:
        check_verl_api(reference)
    message = str(err.value)
    assert f"verl {installed_verl_version()}" in message and f"written for verl {WRITTEN_FOR}" in message
    assert f"verl{SUPPORTED}" in message


def test_registered_losses_accept_exactly_verls_arguments():
    from verl.workers.config import ActorConfig

    from bapo.integrations.verl import BAPOPolicyLossConfig

    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=generator)
    inputs = dict(
        old_log_prob=old,
        log_prob=old + 0.1 * torch.randn(3, 5, generator=generator),
        advantages=torch.randn(3, 1, generator=generator).expand(3, 5).contiguous(),
        response_mask=torch.ones(3, 5, dtype=torch.bool),
        loss_agg_mode="token-mean",
        rollout_is_weights=None,
    )
    assert set(inputs) | {"config"} == set(POLICY_LOSS_ARGS)
    for method in VERL_LOSSES:
        fn = get_policy_loss_fn(method)
        assert tuple(inspect.signature(fn).parameters) == POLICY_LOSS_ARGS
        config = ActorConfig(
            strategy="fsdp",
            ppo_mini_batch_size=4,
            ppo_micro_batch_size_per_gpu=2,
            rollout_n=4,
            policy_loss=BAPOPolicyLossConfig(loss_mode=method),
        )
        loss, metrics = fn(config=config, **inputs)  # by keyword, as verl's ppo_loss calls it
        assert torch.isfinite(loss) and metrics
