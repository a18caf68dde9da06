"""bapo.core: clipped policy losses, the BAPO bound search and its diagnostics (torch only, no I/O)."""

from bapo.core.advantages import group_advantages
from bapo.core.diagnostics import clip_diagnostics, entropy_from_logits, k3_kl, token_ratio
from bapo.core.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    TokenBatch,
    TokenLoss,
    aggregate_loss,
    clipped_surrogate,
    policy_loss,
    register_policy_loss,
)
from bapo.core.search import BAPOConfig, BoundStats, SearchResult, candidate_grid, positive_share, search_bounds
from bapo.core.search_metrics import search_metrics

__all__ = [
    "BAPOConfig", "BoundStats", "LOSS_AGG_MODES", "POLICY_LOSSES", "SearchResult", "TokenBatch", "TokenLoss",
    "aggregate_loss", "candidate_grid", "clip_diagnostics", "clipped_surrogate", "entropy_from_logits",
    "group_advantages", "k3_kl", "policy_loss", "positive_share", "register_policy_loss", "search_bounds", "search_metrics", "token_ratio",
]
