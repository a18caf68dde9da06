"""Diagnostics: clip fractions, quadrants, and the Entropy-Clip Rule's sign on a softmax policy."""

import math

import pytest
import torch

from bapo.core import clip_diagnostics, clip_statistics, entropy_from_logits, policy_loss


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
    metrics = clip_diagnostics(
        torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]]), 0.8, 1.2, logits=logits
    )
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


def _random_batch(seed, batch=6, length=9):
    generator = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(batch, length, generator=generator, dtype=torch.float64)
    log_prob = old + 0.8 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=generator) > 0.25).float()
    entropy = 3.0 * torch.rand(batch, length, generator=generator, dtype=torch.float64)
    weights = 2.0 * torch.rand(batch, length, generator=generator, dtype=torch.float64)
    return log_prob, old, advantages, mask, entropy, weights


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bounds", ["fixed", "per_token"])
def test_statistics_of_micro_batches_add_up_to_the_whole_batch(seed, bounds):
    log_prob, old, advantages, mask, entropy, weights = _random_batch(seed)
    lower, upper = (0.8, 1.3) if bounds == "fixed" else (0.7 + 0.1 * old.exp(), 1.2 + old.exp())
    options = dict(dual_clip=2.0, importance_weights=weights, entropy=entropy)
    whole = clip_statistics(log_prob, old, advantages, mask, lower, upper, **options).finalize()
    parts = None
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part_bounds = [b[rows] if isinstance(b, torch.Tensor) else b for b in (lower, upper)]
        part = clip_statistics(
            log_prob[rows],
            old[rows],
            advantages[rows],
            mask[rows],
            *part_bounds,
            dual_clip=2.0,
            importance_weights=weights[rows],
            entropy=entropy[rows],
        )
        parts = part if parts is None else parts + part
    added = parts.finalize()
    assert added.keys() == whole.keys()
    for key, value in whole.items():
        assert added[key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key


def test_premise_shares_compare_the_clipped_and_the_kept_tokens_of_each_sign():
    """premise/*: among positive tokens, the share of low-probability ones (log pi < -H of their
    state) in those the upper clip removed vs those it kept; the mirror for negative tokens."""
    log_prob = torch.tensor([[-2.0, -3.0, -2.0, -0.5, -0.7, -2.0]])
    old_log_prob = torch.tensor([[-2.5, -3.5, -2.0, -0.5, -0.2, -2.0]])  # ratios 1.65, 1.65, 1, 1, 0.61, 1
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0, -1.0]])
    entropy = torch.ones(1, 6)  # low-probability: log pi < -1
    metrics = clip_diagnostics(log_prob, old_log_prob, advantages, torch.ones(1, 6), 0.8, 1.2, entropy=entropy)
    assert metrics["clip_frac/upper"] == 0.5 and metrics["clip_frac/lower"] == 0.5
    assert metrics["premise/pos_clipped_low_share"] == 1.0  # both clipped positives are low-probability
    assert metrics["premise/pos_kept_low_share"] == 0.5  # one of the two kept ones
    assert metrics["premise/neg_clipped_low_share"] == 0.0  # the clipped negative is high-probability
    assert metrics["premise/neg_kept_low_share"] == 1.0
    nothing_clipped = clip_diagnostics(log_prob, log_prob, advantages, torch.ones(1, 6), 0.8, 1.2, entropy=entropy)
    assert math.isnan(nothing_clipped["premise/pos_clipped_low_share"])
    assert nothing_clipped["premise/pos_kept_low_share"] == 0.75


def test_quadrants_split_per_state_when_entropy_is_given_and_name_the_split():
    # log pi = -1 at a state of entropy 0.5 is *low* for that state (-1 < -0.5) though it is the
    # batch's most likely token; log pi = -2 at entropy 3 is high there (-2 > -3).
    log_prob = torch.tensor([[-1.0, -2.0]])
    advantages = torch.tensor([[1.0, 1.0]])
    entropy = torch.tensor([[0.5, 3.0]])
    per_state = clip_diagnostics(log_prob, log_prob, advantages, torch.ones(1, 2), 0.8, 1.2, entropy=entropy)
    batch_mean = clip_diagnostics(log_prob, log_prob, advantages, torch.ones(1, 2), 0.8, 1.2)
    assert per_state["quadrant/split_per_state"] == 1.0 and batch_mean["quadrant/split_per_state"] == 0.0
    assert per_state["quadrant/low_pos/loss_share"] == pytest.approx(0.5)  # token 0 is low for its state
    assert per_state["quadrant/high_pos/count"] == 1 and per_state["quadrant/low_pos/count"] == 1
    # batch-mean split (mean -1.5): token 0 high, token 1 low
    assert batch_mean["quadrant/high_pos/count"] == 1
    assert batch_mean["quadrant/high_pos/loss_share"] == pytest.approx(0.5)
    _, metrics = policy_loss(log_prob.clone(), log_prob, advantages, torch.ones(1, 2), "grpo", entropy=entropy)
    assert metrics["quadrant/split_per_state"] == 1.0


def test_dual_clipped_tokens_count_as_clipped_everywhere():
    ratio = torch.tensor([[5.0, 1.0, 1.0]])
    log_prob = torch.tensor([[-0.1, -1.0, -2.0]])
    advantages = torch.tensor([[-1.0, -1.0, 1.0]])
    args = (log_prob, log_prob - ratio.log(), advantages, torch.ones(1, 3), 0.8, 1.2)
    capped = clip_diagnostics(*args, dual_clip=3.0)
    free = clip_diagnostics(*args)
    assert capped["clip_frac/dual"] == 0.5 and capped["clip_frac"] == pytest.approx(1 / 3)
    assert free["clip_frac/dual"] == 0.0 and free["clip_frac"] == 0.0
    assert capped["positive_share"] == pytest.approx(0.5) and free["positive_share"] == pytest.approx(1 / 7)
    # the capped token leaves the covariance's signal: A*X over tokens = [0, -1, 1]
    lp = log_prob[0].double()
    signal = torch.tensor([0.0, -1.0, 1.0], dtype=torch.float64)
    assert capped["entropy_change_estimate"] == pytest.approx(
        -float((lp * signal).mean() - lp.mean() * signal.mean()), rel=1e-5
    )


def test_entropy_change_estimate_is_importance_weighted():
    log_prob = torch.tensor([[-0.5, -2.0, -1.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -1.0, 0.5]], dtype=torch.float64)
    weights = torch.tensor([[2.0, 0.5, 1.0]], dtype=torch.float64)
    metrics = clip_diagnostics(log_prob, log_prob, advantages, torch.ones(1, 3), 0.8, 1.2, importance_weights=weights)
    w, lp, s = weights[0], log_prob[0], advantages[0]
    mean = lambda x: float((w * x).sum() / w.sum())  # noqa: E731
    assert metrics["entropy_change_estimate"] == pytest.approx(-(mean(lp * s) - mean(lp) * mean(s)))
    # and the positive share weighs |r*A| by the same weights: (2*1 + 1*0.5) / (2 + 0.5 + 0.5)
    assert metrics["positive_share"] == pytest.approx(2.5 / 3.0)


@pytest.mark.parametrize("case", ["zero_advantages", "empty_mask"])
def test_no_signal_gives_nan_share_and_is_counted(case):
    advantages = torch.zeros(2, 3) if case == "zero_advantages" else torch.ones(2, 3)
    mask = torch.ones(2, 3) if case == "zero_advantages" else torch.zeros(2, 3)
    metrics = clip_diagnostics(torch.zeros(2, 3), torch.zeros(2, 3), advantages, mask, 0.8, 1.2)
    assert math.isnan(metrics["positive_share"]) and metrics["bapo/no_signal"] == 1.0
    with_signal = clip_diagnostics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3), 0.8, 1.2)
    assert with_signal["positive_share"] == 1.0 and with_signal["bapo/no_signal"] == 0.0


def _all_reduce_worker(rank, world_size, init_file, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        log_prob, old, advantages, mask, entropy, weights = _random_batch(11)
        rows = slice(0, 2) if rank == 0 else slice(2, 6)
        stats = clip_statistics(
            log_prob[rows],
            old[rows],
            advantages[rows],
            mask[rows],
            0.8,
            1.3,
            dual_clip=2.0,
            importance_weights=weights[rows],
            entropy=entropy[rows],
        )
        stats.all_reduce()
        results[rank] = stats.finalize()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_finalize_the_whole_batch(tmp_path):
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_all_reduce_worker, args=(2, str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    log_prob, old, advantages, mask, entropy, weights = _random_batch(11)
    whole = clip_diagnostics(
        log_prob, old, advantages, mask, 0.8, 1.3, dual_clip=2.0, importance_weights=weights, entropy=entropy
    )
    for rank in (0, 1):
        assert results[rank].keys() == whole.keys()
        for key, value in whole.items():
            assert results[rank][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_the_diagnostics_share_is_the_searchs_positive_share():
    """One positive share: clip_statistics sums core.search.token_contributions (gradient definition)."""
    from bapo.core.batch import TokenBatch
    from bapo.core.search import positive_share

    generator = torch.Generator().manual_seed(3)
    log_prob = -torch.rand(4, 6, generator=generator) * 3
    old_log_prob = log_prob + torch.randn(4, 6, generator=generator) * 0.4
    advantages = torch.randn(4, generator=generator)
    mask = torch.rand(4, 6, generator=generator) > 0.2
    weights = torch.rand(4, 6, generator=generator) * 2
    batch = TokenBatch.from_log_probs(log_prob, old_log_prob, advantages, mask, importance_weights=weights)
    for lower, upper in ((0.8, 1.2), (0.6, 2.0)):
        metrics = clip_diagnostics(log_prob, old_log_prob, advantages, mask, lower, upper, importance_weights=weights)
        expected = positive_share(batch, lower, upper)
        assert metrics["positive_share"] == pytest.approx(expected, rel=1e-12)


def test_clip_stats_pack_named_sums_in_field_order():
    """ClipStats.of packs named sums (a left-out sum is 0) and maxima; named() reads them back by
    name; a name that is no field fails with it; adding two packs adds sums and takes maxima."""
    from bapo.core.diagnostics import MAX_FIELDS, SUM_FIELDS, ClipStats

    maxima = {name: torch.tensor(float(index)) for index, name in enumerate(MAX_FIELDS)}
    stats = ClipStats.of({"tokens": torch.tensor(5), "parts": 1.0}, maxima)
    named = stats.named()
    assert named["tokens"] == 5.0 and named["parts"] == 1.0 and named["positive"] == 0.0
    assert [named[name] for name in MAX_FIELDS] == [float(i) for i in range(len(MAX_FIELDS))]
    assert stats.sums.dtype == torch.float64 and stats.sums.shape == (len(SUM_FIELDS),)
    other = ClipStats.of({"tokens": 2.0}, {name: torch.tensor(10.0) for name in MAX_FIELDS})
    total = (stats + other).named()
    assert total["tokens"] == 7.0 and all(total[name] == 10.0 for name in MAX_FIELDS)
    with pytest.raises(KeyError, match="tokenz"):
        ClipStats.of({"tokenz": 1.0}, maxima)
    # a micro-batch's statistics name every field they fill
    batch = clip_statistics(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), 0.8, 1.2).named()
    assert batch["tokens"] == 2.0 and batch["positive"] == 2.0 and batch["upper_max"] == 1.2


def test_entropy_by_token_kind_by_hand():
    """Two rows, one padded token: digits {1.0, 3.0} -> 2.0, other {2.0} -> 2.0 ... and the sums add
    across micro-batches (split the rows, add, same metrics)."""
    import torch

    from bapo.core import token_kind_metrics, token_kind_sums

    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    digit = torch.tensor([[True, False, True], [True, False, False]])  # the padded 9.0 never counts
    sums = token_kind_sums(entropy, mask, digit)
    assert sums.tolist() == [4.0, 2.0, 11.0, 3.0]
    metrics = token_kind_metrics(sums)
    assert metrics == {"entropy/digit": 2.0, "entropy/other": 11.0 / 3, "tokens/digit_share": 0.4}
    split = token_kind_sums(entropy[:1], mask[:1], digit[:1]) + token_kind_sums(entropy[1:], mask[1:], digit[1:])
    assert token_kind_metrics(split) == metrics
    empty = token_kind_metrics(token_kind_sums(entropy, mask, torch.zeros_like(digit)))
    assert empty["entropy/digit"] != empty["entropy/digit"] and empty["tokens/digit_share"] == 0.0  # NaN: no digit
