"""bapo.core: clipped policy losses, the BAPO bound search and its diagnostics (torch only, no I/O)."""

from bapo.core.advantages import PromptRewardHistory, group_advantages, smooth_advantages
from bapo.core.batch import TokenBatch
from bapo.core.diagnostics import (
    ClipStats,
    clip_diagnostics,
    clip_statistics,
    entropy_from_logits,
    k3_kl,
    token_kind_metrics,
    token_kind_sums,
    token_ratio,
)
from bapo.core.losses import (
    LOSS_AGG_MODES,
    PAPER_AGG_MODES,
    POLICY_LOSSES,
    PROXIMAL_METHODS,
    TokenLoss,
    aggregate_loss,
    clipped_surrogate,
    off_policy_sequence_mask,
    policy_loss,
    register_policy_loss,
)
from bapo.core.peers import BATCH_LEVEL_METHODS, NO_BOUNDS  # registers the peer losses (gspo, cispo, ...)
from bapo.core.search import (
    BoundStats,
    SearchResult,
    positive_share,
    search_bounds,
    token_contributions,
)
from bapo.core.search_config import BAPOConfig, candidate_grid
from bapo.core.search_metrics import BALANCE_FIELDS, balance_metrics, balance_sums, search_metrics
from bapo.core.step import BAPOStep, MissingStepStateWarning
from bapo.core.target import EntropyTargetController, token_mean_over_ranks

__all__ = [
    "BALANCE_FIELDS",
    "BATCH_LEVEL_METHODS",
    "BAPOConfig",
    "BAPOStep",
    "BoundStats",
    "ClipStats",
    "EntropyTargetController",
    "LOSS_AGG_MODES",
    "MissingStepStateWarning",
    "NO_BOUNDS",
    "PAPER_AGG_MODES",
    "POLICY_LOSSES",
    "PROXIMAL_METHODS",
    "PromptRewardHistory",
    "SearchResult",
    "TokenBatch",
    "TokenLoss",
    "aggregate_loss",
    "balance_metrics",
    "balance_sums",
    "candidate_grid",
    "clip_diagnostics",
    "clip_statistics",
    "clipped_surrogate",
    "entropy_from_logits",
    "group_advantages",
    "k3_kl",
    "off_policy_sequence_mask",
    "policy_loss",
    "positive_share",
    "register_policy_loss",
    "search_bounds",
    "search_metrics",
    "token_kind_metrics",
    "token_kind_sums",
    "smooth_advantages",
    "token_contributions",
    "token_mean_over_ranks",
    "token_ratio",
]
