"""Diagnostics: clip fractions, quadrants, and the Entropy-Clip Rule's sign on a softmax policy."""

import math

import pytest
import torch

from bapo.core import clip_diagnostics, entropy_from_logits, policy_loss


def test_counts_shares_and_covariance_on_a_hand_example():
    ratio = torch.tensor([[1.5, 1.0, 0.5, 1.0]])
    log_prob = torch.tensor([[-0.1, -3.0, -0.2, -2.0]])
    old = log_prob - ratio.log()
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    metrics = clip_diagnostics(log_prob, old, advantages, torch.ones(1, 4), 0.8, 1.2)
    assert metrics["clip_frac/upper"] == pytest.approx(0.5) and metrics["clip_frac/lower"] == pytest.approx(0.5)
    # unclipped: token 1 (A>0, |rA| = 1) and token 3 (A<0, |rA| = 1)
    assert metrics["positive_share"] == pytest.approx(0.5)
    assert metrics["quadrant/high_pos/count"] == 1 and metrics["quadrant/high_pos/clip_frac"] == 1.0
    assert metrics["quadrant/low_pos/loss_share"] == pytest.approx(0.5)
    assert sum(metrics[f"quadrant/{q}/count"] for q in ("high_pos", "high_neg", "low_pos", "low_neg")) == 4
    signal = torch.tensor([0.0, 1.0, 0.0, -1.0])
    lp = log_prob[0]
    covariance = (lp * signal).mean() - lp.mean() * signal.mean()
    assert metrics["entropy_change_estimate"] == pytest.approx(-float(covariance), rel=1e-5)


def test_entropy_from_logits_and_masking():
    logits = torch.zeros(1, 2, 4)  # uniform over 4: entropy log 4
    metrics = clip_diagnostics(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]]), 0.8, 1.2,
                               logits=logits)
    assert metrics["entropy"] == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert metrics["tokens"] == 1 and metrics["approx_kl"] == 0.0


@pytest.mark.parametrize("seed", range(8))
def test_entropy_change_estimate_predicts_the_sign_of_a_real_step(seed):
    """One gradient step of a tabular softmax policy moves entropy the way -Cov[log pi, A X] says."""
    generator = torch.Generator().manual_seed(seed)
    vocab = 12
    logits = (1.5 * torch.randn(vocab, generator=generator)).requires_grad_()
    with torch.no_grad():
        probs = torch.softmax(logits, -1)
        tokens = torch.multinomial(probs, 4000, replacement=True, generator=generator)
        # Rewards that favour either the likely or the unlikely tokens, so the covariance is clear.
        favour_likely = seed % 2 == 0
        token_log_prob = torch.log_softmax(logits, -1)[tokens]
        advantages = (token_log_prob - token_log_prob.mean()) * (1 if favour_likely else -1)
        stale_log_prob = token_log_prob + 0.3 * torch.randn(tokens.shape, generator=generator)
    log_prob = torch.log_softmax(logits, -1)[tokens][None]
    loss, metrics = policy_loss(log_prob, stale_log_prob[None], advantages[None], torch.ones(1, tokens.numel()), "grpo")
    loss.backward()
    with torch.no_grad():
        before = entropy_from_logits(logits[None, None]).item()
        after = entropy_from_logits((logits - 0.5 * logits.grad)[None, None]).item()
    assert (after - before) * metrics["entropy_change_estimate"] > 0
    assert (after < before) == favour_likely  # reinforcing likely tokens lowers entropy


def test_k3_kl_is_nonnegative_finite_and_exact_in_range():
    from bapo.core import k3_kl

    log_ratio = torch.tensor([-1e4, -2.0, 0.0, 0.5, 1e4])
    kl = k3_kl(log_ratio)
    assert torch.isfinite(kl).all() and (kl >= 0).all() and kl[2] == 0
    assert kl[3].item() == pytest.approx(math.exp(0.5) - 0.5 - 1)
    assert kl[0].item() == pytest.approx(math.exp(-20) + 20 - 1)  # clamped like the ratio
