"""BAPO's adaptive bound search (Algorithm 1 of arXiv 2510.18927) as one pass over the tokens.

The loop of the paper moves the ratio bounds along a fixed path of candidates until the
positive share rho reaches its target. rho is monotone along that path, so instead of one pass
per candidate we bucket every token's ratio against the candidate grids once, sum |r*A| per
bucket (positive-advantage tokens against the upper grid, negative ones against the lower grid),
and read the share of every candidate from cumulative sums. Memory is O(tokens + candidates);
the only host sync is reading the answer. The per-bucket sums add up across micro-batches
(`BoundStats.add`) and across data-parallel ranks (one all-reduce in `BoundStats.solve`).
What to search (BAPOConfig, its presets and candidate grids) is bapo.core.search_config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from bapo.core.batch import TokenBatch
from bapo.core.search_config import BAPOConfig
from bapo.core.validation import check_token_inputs, per_token


@dataclass(frozen=True)
class SearchResult:
    """Bounds the search settled on.

    positive_share: rho at (lower, upper) under the config's definition; pos_neg: pos/(neg + eps)
    there (inf when neg == 0); reached: 1.0 when the target was met, 0.0 when the path ran out;
    steps: candidates moved. no_signal: no token contributes at any candidate (e.g. every
    advantage is zero or masked): the bounds stay at the start and positive_share, pos_neg and
    reached are NaN (missing), not 1.0. positive_share is also NaN at a candidate where nothing
    contributes (0/0, which counts as reached: nothing to balance).
    """

    lower: float
    upper: float
    positive_share: float
    reached: float
    steps: int
    pos_neg: float = math.nan
    no_signal: bool = False

    def metrics(self) -> dict[str, float]:
        """Floats under the names bapo logs them (prefix them, e.g. "bapo/search/")."""
        return {
            "lower": self.lower,
            "upper": self.upper,
            "positive_share": self.positive_share,
            "pos_neg": self.pos_neg,
            "reached": self.reached,
            "steps": float(self.steps),
            "no_signal": float(self.no_signal),
        }


def _signed_magnitudes(
    batch: TokenBatch, *, weighting: str, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """(ratio, s) in the compute dtype (float64 for a float64 ratio, else float32), both [B, T]:
    s = A * importance_weights * pi_behaviour (as configured), 0 for masked tokens; sign(s) is
    the token's side and |s| the a of BAPOConfig's contribution definitions."""
    device = device or batch.ratio.device
    compute = torch.float64 if batch.ratio.dtype == torch.float64 else torch.float32
    counted = batch.mask.to(device, torch.bool)
    # a masked position's ratio (padding: inf, NaN) is never read, not even by the bucket index
    ratio = torch.where(counted, batch.ratio.detach().to(device, compute), 1.0)
    signed = per_token(batch.advantages.detach().to(device, compute), ratio)
    if batch.importance_weights is not None:  # w >= 0 keeps each token's side
        signed = signed * batch.importance_weights.detach().to(device, compute)
    if weighting == "behaviour_prob":
        if batch.old_log_prob is None:
            raise ValueError(
                "old_log_prob: required with weighting='behaviour_prob' (paper Eq. 8 weighs each token by "
                "pi_behaviour(y_t)); pass the behaviour log-probs [B, T] in the TokenBatch"
            )
        signed = signed * batch.old_log_prob.detach().to(device, compute).exp()
    return ratio, torch.where(counted, signed, 0.0)


def token_contributions(
    batch: TokenBatch,
    lower: float | Tensor,
    upper: float | Tensor,
    config: BAPOConfig | None = None,
    *,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Each token's contribution to pos and to neg at bounds (lower, upper), float64 [B, T] each
    (zero off its side), under `config`'s contribution and weighting (default BAPOConfig()).

    The one per-token definition of the positive share: `positive_share` sums it, the
    diagnostics (`clip_statistics`) call it, and `BoundStats` is tested equal to it. Bounds may
    be floats or [B, T] tensors; comparisons run in float64 so that a float32/bf16 ratio exactly
    on a grid value decides as it does against the float64 grid. dual_clip: the cap on a negative
    token's ratio (dual-clip PPO; None = off): above it the token is clipped (gradient: counts 0;
    clamped: dual_clip * a). The search never uses it.
    """
    config = config or BAPOConfig()
    ratio, signed = _signed_magnitudes(batch, weighting=config.weighting)
    magnitude = signed.abs()
    unclamped = (ratio * magnitude).double()  # r*a in the compute dtype, then float64, as BoundStats sums it
    ratio64, magnitude64 = ratio.double(), magnitude.double()
    lower = lower.double() if isinstance(lower, Tensor) else lower
    upper = upper.double() if isinstance(upper, Tensor) else upper
    if config.contribution == "gradient":
        positive = torch.where(ratio64 <= upper, unclamped, 0.0)
        negative = torch.where(ratio64 >= lower, unclamped, 0.0)
        if dual_clip is not None:
            negative = torch.where(ratio64 <= dual_clip, negative, 0.0)
    else:
        positive = torch.where(ratio64 <= upper, unclamped, upper * magnitude64)
        negative = torch.where(ratio64 >= lower, unclamped, lower * magnitude64)
        if dual_clip is not None:
            negative = torch.where(ratio64 <= dual_clip, negative, dual_clip * magnitude64)
    return torch.where(signed > 0, positive, 0.0), torch.where(signed < 0, negative, 0.0)


def _check_search_inputs(batch: TokenBatch, weighting: str) -> None:
    """ValueError naming the field of `batch` the search cannot read (old_log_prob only under
    weighting="behaviour_prob", the one that reads it)."""
    named = {"ratio": batch.ratio, "advantages": batch.advantages}
    checks = [
        (
            lambda named: ~((named["ratio"] >= 0) & (named["ratio"] < math.inf)).all(),
            "ratio: must be finite and >= 0; compute it as exp(clamp(log_prob - old_log_prob, -20, 20))",
        )
    ]
    if batch.importance_weights is not None:
        named["importance_weights"] = batch.importance_weights
        checks.append(
            (
                lambda named: (named["importance_weights"] < 0).any(),
                "importance_weights: must be >= 0 (per-token loss multipliers)",
            )
        )
    if weighting == "behaviour_prob" and batch.old_log_prob is not None:
        named["old_log_prob"] = batch.old_log_prob
        checks.append(
            (
                lambda named: (named["old_log_prob"] > 0).any(),
                "old_log_prob: must be <= 0 (the behaviour policy's log-probabilities of the sampled tokens)",
            )
        )
    check_token_inputs(
        named, batch.mask, reference="ratio", allow_row_vector=("advantages",), extra_checks=tuple(checks)
    )


def positive_share(batch: TokenBatch, lower: float, upper: float, config: BAPOConfig | None = None) -> float:
    """rho(lower, upper) = pos / (pos + neg) under `config`'s definition (default: gradient share).

    batch: the fields the search reads (see BoundStats.add). A == 0 and masked tokens count
    nowhere. NaN when nothing contributes (0/0).
    """
    config = config or BAPOConfig()
    _check_search_inputs(batch, config.weighting)
    positive_tokens, negative_tokens = token_contributions(batch, lower, upper, config)
    positive, negative = float(positive_tokens.sum()), float(negative_tokens.sum())
    total = positive + negative
    return math.nan if total == 0.0 else positive / total


def _rounded(values: list[float], dtype: torch.dtype, direction: float) -> Tensor:
    """The grid in `dtype`, rounded toward `direction` (-inf: largest value <= v, +inf: smallest >= v),
    so that comparing a `dtype` ratio against it decides exactly as comparing against the float64 grid."""
    exact = torch.tensor(values, dtype=torch.float64)
    rounded = exact.to(dtype)
    off = rounded.double() > exact if direction < 0 else rounded.double() < exact
    return torch.where(off, torch.nextafter(rounded, torch.full_like(rounded, direction)), rounded)


class BoundStats:
    """Per-bucket sums that add up over micro-batches and ranks; `solve` runs the search.

    With a = |s| the token's weighted advantage magnitude (see BAPOConfig.contribution):
    positive tokens fall in bucket i = #{upper candidates < r} (r*a counts for upper candidates
      j >= i, the clamped value upper_j*a for j < i; i = len(upper_grid): never unclamped);
    negative tokens in bucket i = #{lower candidates <= r} (r*a counts for lower candidates
      j < i, the clamped value lower_j*a for j >= i).
    `sums` holds sum r*a per positive bucket, then per negative bucket, and for
    contribution="clamped" sum a per positive bucket, then per negative bucket: one buffer, one
    all-reduce. r*a is computed in the inputs' precision (at least float32), the sums in float64.

    The bucket is arithmetic (the nearest candidate, round((r - start) / step), then one
    comparison with that candidate rounded toward the safe side in the ratio's dtype), so it
    equals #{edges <= r} exactly (float32, bf16 and float64; values on grid points included).
    """

    def __init__(self, config: BAPOConfig, device: torch.device | str | None = None) -> None:
        self.config = config
        self.device = torch.device(device) if device is not None else None
        self.sums: Tensor | None = None
        self._lower_grid, self._upper_grid = config.lower_grid, config.upper_grid
        self._tables: dict[torch.dtype, tuple] = {}

    @property
    def _side_size(self) -> int:
        return len(self._upper_grid) + len(self._lower_grid) + 2

    def _filled(self) -> Tensor:
        """The sums buffer, which exists once add, all_reduce or solve has run."""
        if self.sums is None:
            raise RuntimeError("BoundStats holds no sums yet: call add, all_reduce or solve first")
        return self.sums

    @property
    def positive_sums(self) -> Tensor:
        """sum r*a of positive tokens per bucket, [len(upper_grid) + 1]."""
        return self._filled()[: len(self._upper_grid) + 1]

    @property
    def negative_sums(self) -> Tensor:
        """sum r*a of negative tokens per bucket, [len(lower_grid) + 1]."""
        return self._filled()[len(self._upper_grid) + 1 : self._side_size]

    @property
    def magnitude_sums(self) -> tuple[Tensor, Tensor] | None:
        """(sum a of positive tokens per bucket, of negative ones) for contribution="clamped", else None."""
        if self.config.contribution != "clamped":
            return None
        sums = self._filled()
        positive_end = self._side_size + len(self._upper_grid) + 1
        return sums[self._side_size : positive_end], sums[positive_end:]

    def _ensure(self, device: torch.device) -> Tensor:
        """The sums buffer, created (zeros) on self.device, else on `device`, if there is none yet."""
        if self.sums is None:
            self.device = self.device or device
            sides = 2 if self.config.contribution == "clamped" else 1
            self.sums = torch.zeros(sides * self._side_size, dtype=torch.float64, device=self.device)
        return self.sums

    def _tables_for(self, dtype: torch.dtype) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Per compute dtype: the regular edges laid out by bucket, [U'..., +inf, L...] (the upper
        side's regular edge k at k, the lower side's at len(upper_grid) + 1 + k), and the rounded
        edges of each side's irregular tail (lower, upper: at most the recipe's clamped last step).
        L: lower grid rounded up (r >= g <=> r >= L); U': upper grid rounded down then one ulp up
        (r > g <=> r >= U'). A point is regular when it lies within a quarter step of start + k*step."""
        if dtype not in self._tables:
            lower = _rounded(self._lower_grid, dtype, +math.inf)
            upper = _rounded(self._upper_grid, dtype, -math.inf)
            upper = torch.nextafter(upper, torch.full_like(upper, math.inf))
            n_lower, n_upper = self._regular_counts
            gap = torch.full((len(self._upper_grid) + 1 - n_upper,), math.inf, dtype=dtype)
            self._tables[dtype] = (
                torch.cat([upper[:n_upper], gap, lower[:n_lower]]).to(self.device),
                tuple(lower[n_lower:].to(self.device)),
                tuple(upper[n_upper:].to(self.device)),
            )
        return self._tables[dtype]

    @property
    def _regular_counts(self) -> tuple[int, int]:
        """How many leading points of the lower and of the upper grid lie on start + k*step."""
        if not hasattr(self, "_regular"):

            def regular(grid: list[float], start: float, step: float) -> int:
                return next(
                    (k for k, value in enumerate(grid) if abs(value - (start + k * step)) > step / 4), len(grid)
                )

            self._regular = (
                regular(self._lower_grid, self.config.lower_start, self.config.lower_step),
                regular(self._upper_grid, self.config.upper_start, self.config.upper_step),
            )
        return self._regular

    def _buckets(self, ratio: Tensor, positive: Tensor) -> Tensor:
        """Histogram index [B*T] (int64) of every token: positive tokens in [0, n_upper], the
        others in n_upper + 1 + [0, n_lower] (see the class docstring). ratio: float32/float64.

        Arithmetic, with one gather: k = the regular candidate nearest to r, i.e.
        round((r - start) / step) clamped to the side's grid; every regular edge below k is then
        <= r and every one above k is > r (float rounding moves a position by far less than half
        a step), so #{edges <= r} = k + [edge_k <= r], plus one comparison per tail edge.
        In-place where possible: fresh multi-MB tensors cost page faults.
        """
        cfg = self.config
        table, lower_tail, upper_tail = self._tables_for(ratio.dtype)
        n_lower, n_upper = self._regular_counts
        lower_offset = len(self._upper_grid) + 1
        ratio, positive = ratio.flatten(), positive.flatten()
        nearest_lower = (ratio - cfg.lower_start).mul_(1.0 / cfg.lower_step).round_().clamp_(0, n_lower - 1)
        nearest_upper = (ratio - cfg.upper_start).mul_(1.0 / cfg.upper_step).round_().clamp_(0, n_upper - 1)
        nearest = torch.where(positive, nearest_upper, nearest_lower.add_(lower_offset), out=nearest_upper)
        bucket = nearest.to(torch.int64)
        bucket += table.take(bucket) <= ratio
        for edge in upper_tail:
            bucket += positive & (ratio >= edge)
        for edge in lower_tail:
            bucket += ~positive & (ratio >= edge)
        return bucket

    def add(self, batch: TokenBatch, *, validate: bool = True) -> BoundStats:
        """Accumulate one micro-batch. The search reads of `batch`: ratio, mask: [B, T];
        advantages: [B, T] or [B]; importance_weights: optional [B, T] per-token loss multipliers
        >= 0 (rollout importance weights, TRL's masks): a token then counts with w*|A|, what it
        contributes to the gradient; old_log_prob: [B, T] log pi_behaviour(y_t), required for
        weighting="behaviour_prob" (not read otherwise). log_prob is never read (it may be None).
        """
        if validate:
            _check_search_inputs(batch, self.config.weighting)
        sums = self._ensure(batch.ratio.device)
        ratio, signed = _signed_magnitudes(batch, weighting=self.config.weighting, device=self.device)
        bucket = self._buckets(ratio, signed > 0)
        magnitude = signed.abs().flatten()
        sums.index_add_(0, bucket, (ratio.flatten() * magnitude).to(torch.float64))
        if self.config.contribution == "clamped":
            sums.index_add_(0, bucket + self._side_size, magnitude.to(torch.float64))
        return self

    def all_reduce(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Sum the bucket sums over ranks with exactly one collective (every rank must call it)."""
        dist.all_reduce(self._require_data(), op=dist.ReduceOp.SUM, group=process_group)

    def _require_data(self) -> Tensor:
        # No tokens seen: an empty histogram on CPU still lets ranks join the collective.
        return self._ensure(self.device or torch.device("cpu"))

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
        return solve_from_sums(self.positive_sums, self.negative_sums, self.config, self.magnitude_sums)


def candidate_sums(
    positive_sums: Tensor,
    negative_sums: Tensor,
    config: BAPOConfig,
    magnitude_sums: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """pos at every upper candidate [n_upper] and neg at every lower candidate [n_lower], from
    BoundStats' bucket sums (magnitude_sums: required for contribution="clamped")."""
    n_upper, n_lower = len(config.upper_grid), len(config.lower_grid)
    positive = torch.cumsum(positive_sums, 0)[:n_upper]  # buckets i <= j: r <= upper_j
    # Buckets i > k: r >= lower_k.
    negative = torch.flip(torch.cumsum(torch.flip(negative_sums, [0]), 0), [0])[1:]
    if config.contribution == "clamped":
        if magnitude_sums is None:
            raise ValueError("magnitude_sums: required for contribution='clamped' (BoundStats.magnitude_sums)")
        positive_magnitude, negative_magnitude = magnitude_sums
        upper = torch.tensor(config.upper_grid, dtype=torch.float64, device=positive.device)
        lower = torch.tensor(config.lower_grid, dtype=torch.float64, device=negative.device)
        # Tokens beyond the bound count at the bound: upper_j * a above it, lower_k * a below it.
        positive = positive + upper * (positive_magnitude.sum() - torch.cumsum(positive_magnitude, 0)[:n_upper])
        negative = negative + lower * torch.cumsum(negative_magnitude, 0)[:n_lower]
    return positive, negative


def search_path(config: BAPOConfig) -> list[tuple[int, int]]:
    """(lower index, upper index) of every candidate Algorithm 1 (or the recipe) visits, in order."""
    lower_moves, upper_moves = len(config.lower_grid) - 1, len(config.upper_grid) - 1
    if config.order == "upper-first":
        return [(0, j) for j in range(upper_moves + 1)] + [(k, upper_moves) for k in range(1, lower_moves + 1)]
    return [(k, 0) for k in range(lower_moves + 1)] + [(lower_moves, j) for j in range(1, upper_moves + 1)]


def solve_from_sums(
    positive_sums: Tensor,
    negative_sums: Tensor,
    config: BAPOConfig,
    magnitude_sums: tuple[Tensor, Tensor] | None = None,
) -> SearchResult:
    """Walk the candidate path on bucket sums (see BoundStats) in one vectorised step, one host sync."""
    positive_at_upper, negative_at_lower = candidate_sums(positive_sums, negative_sums, config, magnitude_sums)
    path = search_path(config)
    device = positive_sums.device
    positive = positive_at_upper[torch.tensor([j for _, j in path], device=device)]
    negative = negative_at_lower[torch.tensor([k for k, _ in path], device=device)]
    total = positive + negative
    nan = torch.full_like(total, math.nan)
    share = torch.where(total > 0, positive / total.clamp_min(torch.finfo(torch.float64).tiny), nan)
    pos_neg = torch.where(
        negative > 0, positive / (negative + config.pos_neg_eps), torch.where(positive > 0, math.inf, nan)
    )
    if config.target_kind == "share":
        reached = (total == 0) | (share >= config.target)  # 0/0: nothing to balance
    else:
        reached = (negative == 0) | (pos_neg >= config.target)  # the recipe: inf when neg == 0
    signal = (total > 0).any()
    any_reached = reached.any()
    step = torch.where(any_reached, reached.to(torch.int64).argmax(), torch.tensor(len(path) - 1, device=device))
    step = torch.where(signal, step, torch.zeros_like(step))
    step_value, share_value, pos_neg_value, reached_value, signal_value = torch.stack(
        [step.to(torch.float64), share[step], pos_neg[step], any_reached.to(torch.float64), signal.to(torch.float64)]
    ).tolist()  # the one host sync of the search
    step_index = int(step_value)
    lower_k, upper_j = path[step_index]
    no_signal = not signal_value
    return SearchResult(
        lower=config.lower_grid[lower_k],
        upper=config.upper_grid[upper_j],
        positive_share=math.nan if no_signal else share_value,
        reached=math.nan if no_signal else reached_value,
        steps=step_index,
        pos_neg=math.nan if no_signal else pos_neg_value,
        no_signal=no_signal,
    )


def search_bounds(batch: TokenBatch, config: BAPOConfig, *, validate: bool = True) -> SearchResult:
    """Bounds of the search on this batch alone (no cross-rank sync; bapo.core.BAPOStep runs
    the search of an optimizer update over micro-batches and ranks).

    batch: the fields the search reads (see BoundStats.add); validate=False skips the input
    checks (a caller that must let a non-finite forward through to its own skip).
    """
    return BoundStats(config, device=batch.ratio.device).add(batch, validate=validate).solve(sync=False)
