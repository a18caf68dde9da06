"""The one metric schema of the BAPO bound search, `bapo/search/*`, shared by bapo.train, the TRL
trainer and the verl worker (verl prefixes `actor/`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bapo.core.search import SCOPES, SearchResult


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
