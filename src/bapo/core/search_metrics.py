"""The one metric schema of the BAPO bound search, `bapo/search/*`, shared by bapo.train, the TRL
trainer and the verl worker (verl prefixes `actor/`), and the per-update balance metrics next to it
(`balance_sums` / `balance_metrics`: response_length/{rewarded, unrewarded}, positive_share/start_bounds)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from bapo.core.batch import TokenBatch
from bapo.core.search import SearchResult, token_contributions
from bapo.core.search_config import SCOPES, BAPOConfig


def search_metrics(searches: Sequence[tuple[SearchResult, int]], scope: str) -> dict[str, float]:
    """bapo/search/{lower, upper, share, pos_neg, reached, no_signal, steps, scope, tokens} of one optimizer update.

    searches: (result, tokens it saw) per search: one for scope "step", one per micro-batch for
    "micro_batch". lower/upper/share/pos_neg/reached/steps are token-weighted means over them
    (equal weights when no tokens), tokens their sum; no_signal the share of searches that had no
    token with a non-zero advantage (their share, pos/neg and reached are NaN: missing, and NaN
    stays NaN in the mean); scope is numeric for loggers: 0 = step, 1 = micro_batch.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope: {scope!r} is not one of {SCOPES}")
    if not searches:
        return {}
    tokens = sum(count for _, count in searches)
    weights = [count / tokens if tokens else 1.0 / len(searches) for _, count in searches]

    def mean(value: Callable[[SearchResult], float]) -> float:
        return sum(weight * float(value(result)) for weight, (result, _) in zip(weights, searches))

    return {
        "bapo/search/lower": mean(lambda result: result.lower),
        "bapo/search/upper": mean(lambda result: result.upper),
        "bapo/search/share": mean(lambda result: result.positive_share),
        "bapo/search/pos_neg": mean(lambda result: result.pos_neg),
        "bapo/search/reached": mean(lambda result: result.reached),
        "bapo/search/no_signal": mean(lambda result: result.no_signal),
        "bapo/search/steps": mean(lambda result: result.steps),
        "bapo/search/scope": float(SCOPES.index(scope)),
        "bapo/search/tokens": float(tokens),
    }


#: Additive sums behind `balance_metrics`, in the order `balance_sums` packs them: tokens and
#: responses of the rewarded and of the unrewarded responses, and pos / neg at BAPO's start bounds.
BALANCE_FIELDS = (
    "rewarded_tokens",
    "rewarded_responses",
    "unrewarded_tokens",
    "unrewarded_responses",
    "start_positive",
    "start_negative",
)


def balance_sums(batch: TokenBatch, rewarded: Tensor, config: BAPOConfig) -> Tensor:
    """float64 [len(BALANCE_FIELDS)] sums of one micro-batch; they add over micro-batches and ranks
    (one SUM all-reduce), and `balance_metrics` turns the total into the update's metrics.

    batch: the fields the search reads (see BoundStats.add; TokenBatch.fresh for a batch these
    weights just sampled), its mask [B, T] the tokens that count; rewarded: [B] bool, the responses
    counted as rewarded (reward > 0, or advantage > 0 in a front end without rewards). pos / neg
    are `token_contributions` at (config.lower_start, config.upper_start) under config's
    definition: what BAPO's search sees before it moves the bounds.
    """
    counted = batch.mask.to(torch.bool)
    lengths = counted.sum(-1).double()  # [B] tokens per response
    rewarded = rewarded.to(device=lengths.device, dtype=torch.bool).reshape(-1)
    positive, negative = token_contributions(batch, config.lower_start, config.upper_start, config)
    return torch.stack(
        [
            lengths[rewarded].sum(),
            rewarded.double().sum(),
            lengths[~rewarded].sum(),
            (~rewarded).double().sum(),
            positive.sum().to(lengths.device),
            negative.sum().to(lengths.device),
        ]
    )


def balance_metrics(sums: Tensor) -> dict[str, float]:
    """The update's response_length/rewarded and response_length/unrewarded (mean tokens per
    response, NaN when the update has none of that kind) and positive_share/start_bounds (the
    share pos / (pos + neg) at BAPO's start bounds, NaN when no token carries signal) from the
    summed `balance_sums` (one host sync). With group-normalised advantages, whole groups, ratio 1
    and token-mean aggregation the share at the start bounds is Lc / (Lc + Lw) of the mixed groups
    (docs/TRAINING.md); the share at the bounds used is the diagnostics' positive_share."""
    values = dict(zip(BALANCE_FIELDS, sums.tolist()))

    def ratio_of(numerator: float, denominator: float) -> float:
        return numerator / denominator if denominator > 0 else math.nan

    return {
        "response_length/rewarded": ratio_of(values["rewarded_tokens"], values["rewarded_responses"]),
        "response_length/unrewarded": ratio_of(values["unrewarded_tokens"], values["unrewarded_responses"]),
        "positive_share/start_bounds": ratio_of(
            values["start_positive"], values["start_positive"] + values["start_negative"]
        ),
    }
