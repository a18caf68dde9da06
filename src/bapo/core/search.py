"""BAPO's adaptive bound search (Algorithm 1 of arXiv 2510.18927) as one pass over the tokens.

The loop of the paper moves the ratio bounds along a fixed path of candidates until the
positive share rho reaches its target. rho is monotone along that path, so instead of one pass
per candidate we bucket every token's ratio against the candidate grids once, sum |r*A| per
bucket (positive-advantage tokens against the upper grid, negative ones against the lower grid),
and read the share of every candidate from cumulative sums. Memory is O(tokens + candidates);
the only host sync is reading the answer. The per-bucket sums add up across micro-batches
(`BoundStats.add`) and across data-parallel ranks (one all-reduce in `BoundStats.solve`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from bapo.core.validation import check_token_inputs, per_token

# Tolerance for "start + k*step <= max" so that a grid meant to end on max (3.0) keeps it
# despite float rounding (1.2 + 36*0.05 = 3.0000000000000004).
GRID_TOLERANCE = 1e-9
ORDERS = ("upper-first", "lower-first")
TARGET_KINDS = ("share", "pos_neg")
SCOPES = ("step", "micro_batch")


@dataclass(frozen=True)
class BAPOConfig:
    """Search space and target of the BAPO bounds. Defaults are the paper's.

    target: rho0, the positive share to reach (target_kind="share", in (0, 1)), or the public
      recipe's pos/neg ratio (target_kind="pos_neg", > 0); a share rho0 equals pos/neg rho0/(1-rho0).
    lower_*: the lower ratio bound starts at lower_start and rises by lower_step up to lower_max.
    upper_*: the upper ratio bound starts at upper_start and rises by upper_step up to upper_max.
    order: "upper-first" (paper: admit more positive tokens first) or "lower-first" (recipe).
    scope: "step" (bounds solved once over every micro-batch of the optimizer step and every rank)
      or "micro_batch" (solved on each micro-batch from the forward it already runs, one
      all-reduce per micro-batch, no extra forward).
    """

    target: float = 0.4
    lower_start: float = 0.6
    lower_max: float = 0.9
    lower_step: float = 0.02
    upper_start: float = 1.2
    upper_max: float = 3.0
    upper_step: float = 0.05
    order: str = "upper-first"
    target_kind: str = "share"
    scope: str = "step"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope: {self.scope!r} is not one of {SCOPES}")
        if self.target_kind not in TARGET_KINDS:
            raise ValueError(f"target_kind: {self.target_kind!r} is not one of {TARGET_KINDS}")
        if self.target_kind == "share" and not 0.0 < self.target < 1.0:
            raise ValueError(
                f"target: {self.target} must lie in (0, 1) for target_kind='share'; "
                f"for a pos/neg ratio pass target_kind='pos_neg'"
            )
        if self.target_kind == "pos_neg" and not self.target > 0.0:
            raise ValueError(f"target: {self.target} must be > 0 for target_kind='pos_neg'")
        if self.order not in ORDERS:
            raise ValueError(f"order: {self.order!r} is not one of {ORDERS}")
        for side, start, maximum, step, ok in (
            ("lower", self.lower_start, self.lower_max, self.lower_step, 0.0 <= self.lower_start <= self.lower_max < 1.0),
            ("upper", self.upper_start, self.upper_max, self.upper_step, 1.0 < self.upper_start <= self.upper_max),
        ):
            if not ok:
                rule = "0 <= lower_start <= lower_max < 1" if side == "lower" else "1 < upper_start <= upper_max"
                raise ValueError(f"{side}_start/{side}_max: ({start}, {maximum}) break the rule {rule}")
            if not step > 0.0:
                raise ValueError(f"{side}_step: {step} must be > 0")

    @property
    def lower_grid(self) -> list[float]:
        return candidate_grid(self.lower_start, self.lower_step, self.lower_max)

    @property
    def upper_grid(self) -> list[float]:
        return candidate_grid(self.upper_start, self.upper_step, self.upper_max)


def candidate_grid(start: float, step: float, maximum: float) -> list[float]:
    """[start + k*step for k = 0..K], K the largest with start + K*step <= maximum (by multiplication)."""
    count = int(math.floor((maximum - start) / step + GRID_TOLERANCE)) + 1
    while count > 1 and start + (count - 1) * step > maximum + GRID_TOLERANCE:
        count -= 1
    return [start + k * step for k in range(count)]


@dataclass(frozen=True)
class SearchResult:
    """Bounds the search settled on. steps: candidates moved; reached: the target was met."""

    lower: float
    upper: float
    positive_share: float
    reached: bool
    steps: int


def _contributions(ratio: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ratio (float64), |r*A| of positive and of negative tokens (float64, zero elsewhere), [B, T].
    |r*A| is computed in the inputs' precision (at least float32), as BoundStats does."""
    compute = torch.float64 if ratio.dtype == torch.float64 else torch.float32
    ratio = ratio.detach().to(compute)
    advantages = per_token(advantages.detach().to(compute), ratio)
    counted = mask.to(torch.bool)
    weight = (ratio * advantages).abs().to(torch.float64)
    positive_weight = torch.where(counted & (advantages > 0), weight, 0.0)
    negative_weight = torch.where(counted & (advantages < 0), weight, 0.0)
    return ratio.to(torch.float64), positive_weight, negative_weight


def _check_search_inputs(ratio: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor | None = None) -> None:
    named = {"ratio": ratio, "advantages": advantages}
    checks = [(lambda named: ~((named["ratio"] >= 0) & (named["ratio"] < math.inf)).all(),
               "ratio: must be finite and >= 0; compute it as exp(clamp(log_prob - old_log_prob, -20, 20))")]
    if weights is not None:
        named["weights"] = weights
        checks.append((lambda named: (named["weights"] < 0).any(), "weights: must be >= 0 (per-token loss multipliers)"))
    check_token_inputs(named, mask, reference="ratio", allow_row_vector=("advantages",), extra_checks=tuple(checks))


def positive_share(ratio: Tensor, advantages: Tensor, mask: Tensor, lower: float, upper: float) -> float:
    """rho(lower, upper): share of sum |r*A| over gradient-carrying tokens that has A > 0.

    ratio, advantages ([B, T] or [B]), mask: [B, T]. A positive token carries gradient while
    r <= upper, a negative one while r >= lower; A == 0 and masked tokens count nowhere.
    Defined as 1.0 when nothing contributes.
    """
    _check_search_inputs(ratio, advantages, mask)
    ratio64, positive_weight, negative_weight = _contributions(ratio, advantages, mask)
    positive = positive_weight[ratio64 <= upper].sum()
    negative = negative_weight[ratio64 >= lower].sum()
    total = positive + negative
    return 1.0 if float(total) == 0.0 else float(positive / total)


def _rounded(values: list[float], dtype: torch.dtype, direction: float) -> Tensor:
    """The grid in `dtype`, rounded toward `direction` (-inf: largest value <= v, +inf: smallest >= v),
    so that comparing a `dtype` ratio against it decides exactly as comparing against the float64 grid."""
    exact = torch.tensor(values, dtype=torch.float64)
    rounded = exact.to(dtype)
    off = rounded.double() > exact if direction < 0 else rounded.double() < exact
    return torch.where(off, torch.nextafter(rounded, torch.full_like(rounded, direction)), rounded)


class BoundStats:
    """Per-bucket sums of |r*A| that add up over micro-batches and ranks; `solve` runs the search.

    positive_sums[i]: |r*A| of positive tokens with i = #{upper candidates < r} (such a token
      counts for upper candidates j >= i; i = len(upper_grid): never counted).
    negative_sums[i]: |r*A| of negative tokens with i = #{lower candidates <= r} (such a token
      counts for lower candidates j < i; i = 0: never counted).
    |r*A| is computed in the inputs' precision (at least float32), the sums in float64.
    """

    def __init__(self, config: BAPOConfig, device: torch.device | str | None = None) -> None:
        self.config = config
        self.device = torch.device(device) if device is not None else None
        self.sums: Tensor | None = None  # positive_sums then negative_sums, one buffer for one all-reduce
        self._boundaries: dict[torch.dtype, Tensor] = {}

    @property
    def positive_sums(self) -> Tensor:
        return self.sums[: len(self.config.upper_grid) + 1]

    @property
    def negative_sums(self) -> Tensor:
        return self.sums[len(self.config.upper_grid) + 1:]

    def _ensure(self, device: torch.device) -> None:
        if self.sums is None:
            self.device = self.device or device
            self.sums = torch.zeros(len(self.config.upper_grid) + len(self.config.lower_grid) + 2,
                                    dtype=torch.float64, device=self.device)

    def _boundaries_for(self, dtype: torch.dtype) -> Tensor:
        """Lower grid then upper grid (lower_max < 1 < upper_start keeps them apart), as one sorted
        tensor B such that #{B_i <= r} counts the lower candidates <= r, plus the upper candidates < r."""
        if dtype not in self._boundaries:
            lower = _rounded(self.config.lower_grid, dtype, +math.inf)          # r >= g  <=>  r >= up(g)
            upper = _rounded(self.config.upper_grid, dtype, -math.inf)          # r >  g  <=>  r >  down(g)
            upper = torch.nextafter(upper, torch.full_like(upper, math.inf))    # r > d   <=>  r >= next(d)
            self._boundaries[dtype] = torch.cat([lower, upper]).to(self.device)
        return self._boundaries[dtype]

    def add(self, ratio: Tensor, advantages: Tensor, mask: Tensor, *, weights: Tensor | None = None,
            validate: bool = True) -> "BoundStats":
        """Accumulate one micro-batch. ratio, mask: [B, T]; advantages: [B, T] or [B].

        weights: optional [B, T] per-token loss multipliers >= 0 (rollout importance weights, TRL's
        masks): a token then contributes w*|r*A|, what it contributes to the gradient.
        """
        if validate:
            _check_search_inputs(ratio, advantages, mask, weights)
        self._ensure(ratio.device)
        compute = torch.float64 if ratio.dtype == torch.float64 else torch.float32
        ratio = ratio.detach().to(self.device, compute)
        advantages = per_token(advantages.detach().to(self.device, compute), ratio)
        if weights is not None:  # w >= 0 keeps each token's side; |r*(w*A)| = w*|r*A|
            advantages = advantages * weights.detach().to(self.device, compute)
        counted = mask.to(self.device, torch.bool)
        positive, negative = counted & (advantages > 0), counted & (advantages < 0)

        lower_count = len(self.config.lower_grid)
        below = torch.bucketize(ratio, self._boundaries_for(compute), right=True, out_int32=True)  # #{B_i <= r}
        upper_bucket = (below - lower_count).clamp_(min=0)
        lower_bucket = below.clamp_(max=lower_count)
        # One histogram for both sides: positive tokens in [0, n_upper], negative ones after them.
        bucket = torch.where(positive, upper_bucket, lower_bucket + len(self.config.upper_grid) + 1)
        weight = torch.where(positive | negative, (ratio * advantages).abs(), 0.0)
        self.sums.index_add_(0, bucket.flatten(), weight.flatten().to(torch.float64))
        return self

    def all_reduce(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Sum the bucket sums over ranks with exactly one collective (every rank must call it)."""
        self._require_data()
        dist.all_reduce(self.sums, op=dist.ReduceOp.SUM, group=process_group)

    def _require_data(self) -> None:
        if self.sums is None:
            # No tokens seen: an empty histogram on CPU still lets ranks join the collective.
            self._ensure(self.device or torch.device("cpu"))

    def solve(self, process_group: dist.ProcessGroup | None = None, sync: bool | None = None) -> SearchResult:
        """Run the search on the accumulated sums.

        sync: sum over ranks first (one all-reduce); None = whenever torch.distributed is
        initialised. Every rank then returns identical bounds.
        """
        self._require_data()
        if sync is None:
            sync = dist.is_available() and dist.is_initialized()
        if sync:
            self.all_reduce(process_group)
        return solve_from_sums(self.positive_sums, self.negative_sums, self.config)


def solve_from_sums(positive_sums: Tensor, negative_sums: Tensor, config: BAPOConfig) -> SearchResult:
    """Walk the candidate path of Algorithm 1 on bucket sums (see BoundStats) in one vectorised step."""
    lower_grid, upper_grid = config.lower_grid, config.upper_grid
    positive_at_upper = torch.cumsum(positive_sums, 0)[: len(upper_grid)]          # [n_upper]
    # Sum over buckets i > j: tokens with r >= lower_grid[j].
    negative_at_lower = torch.flip(torch.cumsum(torch.flip(negative_sums, [0]), 0), [0])[1:]  # [n_lower]

    # The path Algorithm 1 walks: (lower k, upper j) of every candidate in visiting order.
    lower_moves, upper_moves = len(lower_grid) - 1, len(upper_grid) - 1
    if config.order == "upper-first":
        path = [(0, j) for j in range(upper_moves + 1)] + [(k, upper_moves) for k in range(1, lower_moves + 1)]
    else:
        path = [(k, 0) for k in range(lower_moves + 1)] + [(lower_moves, j) for j in range(1, upper_moves + 1)]
    device = positive_sums.device
    lower_index = torch.tensor([k for k, _ in path], device=device)
    upper_index = torch.tensor([j for _, j in path], device=device)

    positive = positive_at_upper[upper_index]
    negative = negative_at_lower[lower_index]
    total = positive + negative
    share = torch.where(total > 0, positive / total.clamp_min(torch.finfo(torch.float64).tiny), torch.ones_like(total))
    if config.target_kind == "share":
        reached = share >= config.target
    else:
        reached = positive >= config.target * negative  # pos/neg >= target, with neg == 0 counting as reached
    any_reached = reached.any()
    step = torch.where(any_reached, reached.to(torch.int64).argmax(), torch.tensor(len(share) - 1, device=device))
    step_value, share_value, reached_value = torch.stack(
        [step.to(torch.float64), share[step], any_reached.to(torch.float64)]
    ).tolist()  # the one host sync of the search
    step_index = int(step_value)
    lower_k, upper_j = path[step_index]
    return SearchResult(
        lower=lower_grid[lower_k],
        upper=upper_grid[upper_j],
        positive_share=share_value,
        reached=bool(reached_value),
        steps=step_index,
    )


def search_bounds(ratio: Tensor, advantages: Tensor, mask: Tensor, config: BAPOConfig, *,
                  weights: Tensor | None = None) -> SearchResult:
    """Bounds of Algorithm 1 on this batch alone (no cross-rank sync; use BoundStats for that).

    ratio, mask: [B, T]; advantages: [B, T] or [B]; weights: optional [B, T] (see BoundStats.add).
    """
    return BoundStats(config, device=ratio.device).add(ratio, advantages, mask, weights=weights).solve(sync=False)
