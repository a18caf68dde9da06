"""`BAPOStep`: BAPO's protocol for one optimizer update, the same for every front end.

An optimizer update (one `optimizer.step()`) runs over one or more micro-batches, on one or
more data-parallel ranks. BAPO needs, per update: the search config of this update (rho0 set by
the entropy-target controller), the bounds (solved once over the whole update, scope "step", or
on each micro-batch, scope "micro_batch"), the `bapo/search/*` metrics, and after the update the
controller fed with the update's entropy. `BAPOStep` owns all of it; a front end (bapo.train,
TRL, verl, the lab) only turns its batch format into a `TokenBatch`:

    step = BAPOStep(config)                  # once per run; state_dict() goes into checkpoints
    step.begin(micro_batches=len(micro))     # each optimizer update
    if step.needs_pre_pass(fresh):           # scope "step": bounds over every micro-batch first
        for mb in micro:
            step.observe(TokenBatch.fresh(...) if fresh else batch_of(mb))
        step.solve()                         # one all-reduce when torch.distributed is up
    for mb in micro:
        found = step.bounds_for(batch_of(mb))
        loss = policy_loss(..., "bapo", bounds=found)
        step.record_entropy(entropy_of(mb), mb.mask)   # only read under target_mode="entropy"
    metrics.update(step.metrics())           # bapo/search/* and bapo/target
    step.end()                               # feeds the controller (entropy mode: one all-reduce)

The fresh-batch shortcut: a batch the current weights have just generated (and scored the
behaviour log-probs of) has every ratio exactly 1, so `observe(TokenBatch.fresh(...))` searches
it without a forward. Whether a batch is fresh is the front end's knowledge (bapo.train: policy
versions; TRL: its generation counter); what follows from it is decided here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from bapo.core.batch import TokenBatch
from bapo.core.search import BoundStats, SearchResult
from bapo.core.search_config import BAPOConfig
from bapo.core.search_metrics import search_metrics
from bapo.core.target import EntropyTargetController, token_mean_over_ranks

#: Version of `BAPOStep.state_dict()`'s layout (checkpoints of every front end hold this dict).
STATE_VERSION = 1


class MissingStepStateWarning(UserWarning):
    """A resumed run found no BAPO step state (entropy controller) in its checkpoint."""


class BAPOStep:
    """The BAPO bounds, metrics and adaptive target of one optimizer update after another.

    config: the run's BAPOConfig (scope, search space, share definition, target control).
    device: where the bucket sums live (e.g. CPU for a gloo process group); None = the ratios'.
    process_group: the data-parallel group the searches all-reduce over (None: the default group).
    controller: the entropy-target controller (default: a fresh one from config; pass a
      subclass to observe it). In target_mode="fixed" it only counts updates.
    """

    def __init__(
        self,
        config: BAPOConfig,
        *,
        device: torch.device | str | None = None,
        process_group: dist.ProcessGroup | None = None,
        controller: EntropyTargetController | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device) if device is not None else None
        self.process_group = process_group
        self.in_update = False  # between begin() and end()
        self.controller = controller or EntropyTargetController(config)
        self.searches: list[tuple[SearchResult, int | Tensor]] = []  # (result, tokens it saw) of this update
        self._stats: BoundStats | None = None
        self._observed_tokens: list[Tensor] = []
        self._solved: SearchResult | None = None
        self._micro_batches: int | None = None
        self._entropy_sums: list[Tensor] = []  # [sum of entropy, tokens] per recorded micro-batch

    # ---- what this update searches with ----------------------------------------------------------

    @property
    def scope(self) -> str:
        """ "step" (bounds over the whole update) or "micro_batch" (each micro-batch alone)."""
        return self.config.scope

    @property
    def target(self) -> float:
        """rho0 of the update in progress (the controller's current output)."""
        return self.controller.target

    @property
    def search_config(self) -> BAPOConfig:
        """The BAPOConfig this update's searches run with (config with target = rho0)."""
        return self.controller.search_config()

    @property
    def solved(self) -> SearchResult | None:
        """The update's bounds from `solve` (scope "step"); None before it, or when none ran."""
        return self._solved

    # ---- one optimizer update ---------------------------------------------------------------------

    def begin(self, micro_batches: int | None = None) -> None:
        """Start an optimizer update: no statistics, no searches, no recorded entropy yet.

        micro_batches: how many micro-batches the update runs (None: unknown). With exactly one,
        scope "step" searches it from the forward its loss runs anyway (`bounds_for`), since a
        pre-pass would only repeat that forward.
        """
        self.in_update = True
        self.searches = []
        self._stats = None
        self._observed_tokens = []
        self._solved = None
        self._micro_batches = micro_batches
        self._entropy_sums = []

    def needs_pre_pass(self, fresh: bool = False) -> bool:
        """Whether `observe` must see every micro-batch before the first loss (scope "step").

        fresh: the update's batch was just generated by the current weights (every ratio is 1,
        so the pre-pass costs no forward and runs even for a single micro-batch).
        """
        return self.scope == "step" and (fresh or self._micro_batches != 1)

    def observe(self, batch: TokenBatch, *, validate: bool = True) -> None:
        """Add one micro-batch to the update's search (the pre-pass of scope "step").

        batch: the fields the search reads (see BoundStats.add): ratio [B, T] current / behaviour
        probability of each token (`TokenBatch.fresh` for a batch just generated by the current
        weights: every ratio exactly 1, no forward needed), advantages [B, T] or [B], mask [B, T],
        optional importance_weights [B, T] >= 0, old_log_prob [B, T] (for weighting="behaviour_prob").
        """
        if self._stats is None:
            self._stats = BoundStats(self.search_config, device=self.device)
        self._stats.add(batch, validate=validate)
        self._observed_tokens.append(batch.mask.to(torch.bool).sum())

    def solve(self, *, sync: bool | None = None) -> SearchResult:
        """The update's bounds over everything `observe` saw (sync: sum over the process group's
        ranks first, one all-reduce; None = whenever torch.distributed is initialised). Every
        rank must call it, also one that observed nothing."""
        stats = self._stats or BoundStats(self.search_config, device=self.device)
        tokens = torch.stack(self._observed_tokens).sum() if self._observed_tokens else 0
        return self.adopt(stats.solve(process_group=self.process_group, sync=sync), tokens)

    def adopt(self, solved: SearchResult, tokens: int | Tensor = 0) -> SearchResult:
        """Take `solved` as this update's bounds (scope "step"): what `solve` does with its own
        result; also for bounds solved elsewhere. tokens: how many this rank's search saw."""
        self._solved = solved
        self.searches.append((solved, tokens))
        return solved

    def bounds_for(
        self, batch: TokenBatch, *, sync: bool | None = None, validate: bool = False, alone: bool = False
    ) -> SearchResult:
        """The bounds of one micro-batch's loss (batch as in `observe`, its ratio from the forward
        the loss runs; the search reads it detached).

        Scope "step": the update's bounds from `solve`, or, for an update of one micro-batch
        without a pre-pass, the search on this micro-batch. Scope "micro_batch": the search on
        this micro-batch (sync: one all-reduce of its bucket sums, see `solve`). alone=True: the
        search on this batch by itself whatever the scope, not recorded in the update's metrics
        (e.g. an evaluation batch). validate=False by default: a non-finite forward must reach
        the caller's skip, not raise here.
        """
        if self._solved is not None and not alone:
            return self._solved
        if self.scope == "step" and self.needs_pre_pass() and not alone:
            raise RuntimeError(
                "BAPOStep.bounds_for: scope 'step' needs the update's bounds first: call observe on every "
                "micro-batch and solve, or begin(micro_batches=1) for an update of one micro-batch"
            )
        stats = BoundStats(self.search_config, device=self.device)
        stats.add(batch, validate=validate)
        found = stats.solve(process_group=self.process_group, sync=sync)
        if not alone:
            self.searches.append((found, batch.mask.to(torch.bool).sum()))
        return found

    def record_entropy(self, entropy: Tensor, mask: Tensor) -> None:
        """Add one micro-batch's policy entropy ([B, T], masked by mask [B, T]) to the update's;
        `end` feeds the token mean to the controller. No host sync."""
        counted = mask.to(torch.bool)
        entropy = entropy.detach()
        self._entropy_sums.append(
            torch.stack([torch.where(counted, entropy, 0.0).sum().double(), counted.sum().double()])
        )

    def end(
        self,
        entropy: float | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Close the update: feed the controller the update's token-mean entropy, so the next
        update searches with its rho0.

        entropy: the entropy measured by the caller; None = the token mean of what
        `record_entropy` saw, over every rank (target_mode="entropy": one all-reduce, every rank
        must call it; device: where that collective's tensor lives). NaN (no tokens, a skipped
        update) leaves rho0 unchanged. In target_mode="fixed" nothing is communicated.
        """
        if entropy is None:
            entropy = math.nan
            if self.config.target_mode == "entropy":
                total, count = torch.stack(self._entropy_sums).sum(0).tolist() if self._entropy_sums else (0.0, 0.0)
                entropy = token_mean_over_ranks(total, count, device=device, process_group=process_group)
        self.controller.update(entropy)
        self._entropy_sums = []
        self.in_update = False

    # ---- metrics and state ------------------------------------------------------------------------

    def metrics(self, searches: Sequence[tuple[SearchResult, int | Tensor]] | None = None) -> dict[str, float]:
        """bapo/search/* (bapo.core.search_metrics) and bapo/target of the update's searches.

        searches: the (result, tokens) pairs to report (e.g. `step.searches[-1:]` for the latest
        one only); None = every search of this update. {} plus bapo/target when none ran.
        """
        searches = self.searches if searches is None else searches
        counts = [tokens for _, tokens in searches]
        if any(isinstance(count, Tensor) for count in counts):  # one host sync for all of them
            counts = torch.stack([torch.as_tensor(count).to(torch.int64).cpu() for count in counts]).tolist()
        return {
            **search_metrics([(result, int(count)) for (result, _), count in zip(searches, counts)], self.scope),
            "bapo/target": self.search_config.target,
        }

    def state_dict(self) -> dict:
        """The run-long state to checkpoint (plain Python values: JSON- and torch.save-able)."""
        return {"version": STATE_VERSION, "controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict | None, source: str = "the checkpoint") -> None:
        """Restore `state_dict()`'s output. None (a checkpoint without it): under
        target_mode="entropy" warn (MissingStepStateWarning, naming `source`) and start the
        controller afresh from config.target; in fixed mode there is nothing to restore."""
        if state is None:
            if self.config.target_mode == "entropy":
                warnings.warn(
                    f"bapo: {source} has no entropy-controller state (BAPOStep.state_dict; saved by a run with "
                    f"target_mode=fixed or before bapo saved it); the controller starts afresh from target "
                    f"{self.config.target}",
                    MissingStepStateWarning,
                    stacklevel=2,
                )
            self.controller = type(self.controller)(self.config)
            return
        self.controller.load_state_dict(state["controller"])
