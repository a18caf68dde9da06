"""One optimizer update on one mini-batch: micro-batch gradient accumulation, BAPO's bounds
(bapo.core.BAPOStep: over the whole update, or per micro-batch: `loss.bapo.scope`), optional KL /
entropy terms, gradient clipping, and skipping of non-finite updates."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch

from bapo.core import (
    BAPOStep,
    ClipStats,
    TokenBatch,
    aggregate_loss,
    balance_metrics,
    balance_sums,
    k3_kl,
    off_policy_sequence_mask,
    policy_loss,
    token_kind_metrics,
    token_kind_sums,
)
from bapo.core.losses import PROXIMAL_METHODS, resolve_loss_params
from bapo.train.config import TrainConfig
from bapo.train.correction import correction_weights, mismatch_metrics
from bapo.train.logprobs import batched_log_probs, token_log_probs
from bapo.train.lora import adapter_dropout
from bapo.train.rollout import Batch


def _normalizer(cfg: TrainConfig, batch: Batch) -> float:
    """The denominator of the whole update (for the resolved aggregation), so that micro-batch losses add up to it."""
    mode = cfg.loss.resolved_agg_mode
    if mode == "token-mean":
        return float(max(batch.tokens, 1))
    if mode == "seq-mean-token-sum-norm":
        return float(len(batch) * cfg.rollout.max_new_tokens)
    return float(len(batch))


def _forward(model, mb: Batch, cfg: TrainConfig, with_entropy: bool = True):
    """Current-policy log-probs [n, R] (with grad unless under no_grad) and, with_entropy, the
    entropy [n, R] (grad only when it is a loss term), under cfg.model.autocast. model.lora.dropout
    acts in the forwards with grad only (the loss's); a no-grad one reads the policy without it."""
    dropout = adapter_dropout(model) if torch.is_grad_enabled() else contextlib.nullcontext()
    with dropout:
        return token_log_probs(
            model,
            mb.prompt_ids,
            mb.prompt_mask,
            mb.response_ids,
            mb.response_mask,
            cfg.rollout.temperature,
            with_entropy=with_entropy,
            entropy_grad=with_entropy and cfg.loss.entropy_coef > 0,
            autocast=cfg.model.autocast,
            shared_prompt=cfg.model.shared_prompt_forward,
        )


def behaviour_is_current(batch: Batch, version: int | None) -> bool:
    """Whether every token of `batch` was sampled, and its behaviour log-prob computed, by policy
    `version` (the weights about to be updated): then every ratio is 1 before the first update."""
    return version is not None and bool((batch.versions[batch.response_mask] == version).all())


def token_weights(mb: Batch, cfg: TrainConfig, log_prob: torch.Tensor) -> torch.Tensor | None:
    """The per-token weights [n, R] the loss and BAPO's search both get (None: none): the rollout
    correction's, times the off-policy sequence mask (loss.off_policy_mask) of the current
    log-probs `log_prob` [n, R] against the sampler's (the engine's when there is one)."""
    weights, _ = importance_weights(mb, cfg)
    if cfg.loss.off_policy_mask is None:
        return weights
    sampler = mb.engine_log_prob if mb.engine_log_prob is not None else mb.old_log_prob
    keep = off_policy_sequence_mask(log_prob, sampler, mb.advantages, mb.response_mask, cfg.loss.off_policy_mask)
    return keep.float() if weights is None else weights * keep.to(weights.dtype)


def importance_weights(mb: Batch, cfg: TrainConfig) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rollout-correction weights [n, R] or None, raw engine-vs-trainer ratios [n, R] or None):
    None, None unless the batch carries the engine's log-probs (rollout.backend=vllm)."""
    if mb.engine_log_prob is None:
        return None, None
    rollout = cfg.rollout
    return correction_weights(
        mb.old_log_prob,
        mb.engine_log_prob,
        mb.response_mask,
        rollout.correction,
        rollout.correction_level,
        rollout.correction_cap,
        rollout.correction_lower,
    )


def _observe_update(
    model, micro: list[Batch], cfg: TrainConfig, bapo_step: BAPOStep, fresh: bool
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """BAPOStep's pre-pass over every micro-batch of the update: ratio 1 without a forward for a
    batch the current weights just generated (`fresh`), else from a forward. The weights do not
    change before the optimizer step, so the first micro-batch's forward is the one its loss
    needs: it runs with grad and is returned (log_prob, entropy) for that loss (one forward fewer
    per update, at the memory of one micro-batch's graph during the others' no-grad forwards)."""
    first = None
    for index, mb in enumerate(micro):
        if fresh:  # the current policy is the behaviour one: every ratio is 1
            weights = token_weights(mb, cfg, mb.old_log_prob)
            batch = TokenBatch.fresh(
                mb.advantages, mb.response_mask, old_log_prob=mb.old_log_prob, importance_weights=weights
            )
        else:
            if index == 0:
                first = _forward(model, mb, cfg)
                log_prob = first[0].detach()
            else:
                with torch.no_grad():
                    log_prob, _ = _forward(model, mb, cfg, with_entropy=False)
            batch = _search_batch(mb, log_prob, token_weights(mb, cfg, log_prob))
        bapo_step.observe(batch)
    return first


def _search_batch(mb: Batch, log_prob: torch.Tensor, weights: torch.Tensor | None) -> TokenBatch:
    """What BAPO's search reads of micro-batch `mb` at the current log-probs [B, T] (detached)."""
    return TokenBatch.from_log_probs(
        log_prob, mb.old_log_prob, mb.advantages, mb.response_mask, importance_weights=weights
    )


def with_proximal_log_prob(model, batch: Batch, cfg: TrainConfig, version: int | None) -> Batch:
    """`batch` with its proximal log-probs (decoupled PPO): the log-probs of the current weights
    (policy `version`), the policy before the first of the updates this batch is about to get.

    A token that `version` itself sampled keeps its behaviour log-prob: there the proximal policy
    *is* the behaviour policy, so its weight pi_prox / mu is exp(0) = 1 by construction, whatever
    the kernels (a second forward would differ from the sampler's in the last bits). Only tokens
    of older versions (an async delay, partial rollout, replay) need the no-grad forward, which
    runs only when there are some. version None (unknown): every token from the forward."""
    fresh = ~batch.response_mask if version is None else (batch.versions == version) | ~batch.response_mask
    if bool(fresh.all()):
        return dataclasses.replace(batch, proximal_log_prob=batch.old_log_prob)
    forward = batched_log_probs(
        model,
        batch.prompt_ids,
        batch.prompt_mask,
        batch.response_ids,
        batch.response_mask,
        cfg.rollout.temperature,
        cfg.rollout.logprob_batch_size,
        cfg.model.autocast,
        cfg.model.shared_prompt_forward,
    ).to(batch.old_log_prob.device)
    return dataclasses.replace(batch, proximal_log_prob=torch.where(fresh, batch.old_log_prob, forward))


def loss_params(cfg: TrainConfig) -> dict:
    """policy_loss's keyword parameters from cfg.loss (its params, plus loss.dual_clip for a method that takes one)."""
    return resolve_loss_params(cfg.loss.method, cfg.loss.params, {"dual_clip": cfg.loss.dual_clip})


def _begin_bapo_update(
    model, micro: list[Batch], cfg: TrainConfig, bapo_step: BAPOStep, fresh: bool
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Start BAPO's update: scope "step" solves the bounds over every micro-batch first (the
    pre-pass), unless the update's one micro-batch serves from its own forward. Returns the
    first micro-batch's forward when the pre-pass ran it (for its loss), else None."""
    bapo_step.begin(micro_batches=len(micro))
    first = None
    if bapo_step.needs_pre_pass(fresh):
        first = _observe_update(model, micro, cfg, bapo_step, fresh)
        bapo_step.solve()
    return first


def _micro_batch_loss(
    model,
    mb: Batch,
    cfg: TrainConfig,
    params: dict,
    normalizer: float,
    bapo_step: BAPOStep | None,
    stats: ClipStats,
    forward: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    digit_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float], dict[str, float], torch.Tensor | None, torch.Tensor]:
    """One micro-batch's forward and loss: (scalar loss to backward, its terms {loss, kl_loss,
    entropy_loss} as floats, the method's own metrics, the entropy split by token kind as
    bapo.core.token_kind_sums, digit tokens vs the rest, when `digit_ids` [V'] is given, and its
    bapo.core.balance_sums: lengths of rewarded (reward > 0) vs other responses, and the positive
    share at BAPO's start bounds loss.bapo.{lower,upper}_start, for every method).
    Diagnostics are added into `stats`.
    forward: this micro-batch's (log_prob, entropy) when already computed with grad (the pre-pass)."""
    log_prob, entropy = _forward(model, mb, cfg) if forward is None else forward
    kind_sums = None
    if digit_ids is not None and entropy is not None:
        kind_mask = torch.isin(mb.response_ids, digit_ids.to(mb.response_ids.device))
        kind_sums = token_kind_sums(entropy, mb.response_mask, kind_mask)
    weights = token_weights(mb, cfg, log_prob.detach())  # the loss and BAPO's search see the same weights
    search_batch = _search_batch(mb, log_prob.detach(), weights)
    balance = balance_sums(search_batch, mb.rewards > 0, cfg.loss.bapo_config())
    if bapo_step is not None:
        found = bapo_step.bounds_for(search_batch)
        params = {**params, "bounds": (found.lower, found.upper)}
    mode = cfg.loss.resolved_agg_mode
    loss, metrics = policy_loss(
        log_prob,
        mb.old_log_prob,
        mb.advantages,
        mb.response_mask,
        cfg.loss.method,
        loss_agg_mode=mode,
        normalizer=normalizer,
        importance_weights=weights,
        entropy=entropy,
        stats=stats,
        **({} if mb.proximal_log_prob is None else {"proximal_log_prob": mb.proximal_log_prob}),
        **params,
    )
    terms = {"loss": metrics.pop("loss")}
    if cfg.loss.kl_coef > 0:  # k3 estimate of KL(pi || ref), verl's "low_var_kl"
        kl = aggregate_loss(k3_kl(mb.ref_log_prob - log_prob), mb.response_mask, mode, normalizer)
        loss = loss + cfg.loss.kl_coef * kl
        terms["kl_loss"] = float(kl.detach())
    if cfg.loss.entropy_coef > 0:
        bonus = aggregate_loss(entropy, mb.response_mask, mode, normalizer)
        loss = loss - cfg.loss.entropy_coef * bonus
        terms["entropy_loss"] = float(bonus.detach())
    return loss, terms, metrics, kind_sums, balance


def _step_optimizer(model, optimizer, scheduler, cfg: TrainConfig, finite: bool) -> dict:
    """Clip the accumulated gradient and step (or drop it when the loss or its norm is not
    finite): {grad_norm (before clipping), lr (of this update), skipped}."""
    max_norm = cfg.optim.max_grad_norm or float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)) if finite else float("nan")
    skipped = not (finite and math.isfinite(grad_norm))
    lr = scheduler.get_last_lr()[0]
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        scheduler.step()
    return {"grad_norm": grad_norm, "lr": lr, "skipped": int(skipped)}


def optimizer_update(
    model,
    optimizer,
    scheduler,
    batch: Batch,
    cfg: TrainConfig,
    bapo_step: BAPOStep | None = None,
    version: int | None = None,
    digit_ids: torch.Tensor | None = None,
) -> dict:
    """Forward+backward over micro-batches of `batch` (on the model's device), then one step.

    Returns metrics: every policy_loss diagnostic over all micro-batches (bapo.core.ClipStats,
    summed then finalized once), the losses (micro-batch terms add up to the update's), the
    method's own metrics (mean over micro-batches), grad_norm
    (before clipping), lr, skipped (1 when the loss or gradient was non-finite and no step was taken).
    bapo_step: method bapo's per-update protocol (bounds, rho0, bapo/search/* and bapo/target);
    this function owns one update of it: `begin` before the micro-batches, `end` with the update's
    entropy after them (the next update's rho0). The trainer passes its run-long one; None = a
    fresh BAPOStep of cfg.loss.bapo for this update alone. version: the policy version of the current
    weights; when every token of `batch` has it (just generated, first update), the step-scope
    search needs no extra forward. digit_ids: the token ids that spell a digit
    (bapo.train.data.digit_token_ids); given, the metrics add entropy/digit, entropy/other and
    tokens/digit_share (bapo.core.token_kind_metrics: the answer tokens of an arithmetic task
    vs the words around them).
    """
    start = time.perf_counter()
    if cfg.loss.method in PROXIMAL_METHODS and batch.proximal_log_prob is None:
        batch = with_proximal_log_prob(model, batch, cfg, version)  # this update is the first on `batch`
    micro = [
        batch.select(torch.arange(s, min(s + cfg.optim.micro_batch_size, len(batch))))
        for s in range(0, len(batch), cfg.optim.micro_batch_size)
    ]
    normalizer = _normalizer(cfg, batch)
    params = loss_params(cfg)
    if cfg.loss.method != "bapo":
        bapo_step = None
    elif bapo_step is None:
        bapo_step = BAPOStep(cfg.loss.bapo_config())
    first_forward = None  # the first micro-batch's forward, when BAPO's pre-pass has run it
    if bapo_step is not None:
        first_forward = _begin_bapo_update(model, micro, cfg, bapo_step, behaviour_is_current(batch, version))

    optimizer.zero_grad(set_to_none=True)
    diagnostic_sums: ClipStats | None = None  # the diagnostics' sums over the finite micro-batches
    losses: dict[str, float] = {}  # each term uses the update's normalizer, so micro-batch values add up
    own_metrics: list[dict[str, float]] = []
    kind_total: torch.Tensor | None = None  # token_kind_sums over the finite micro-batches
    balance_total: torch.Tensor | None = None  # balance_sums over the finite micro-batches
    finite = True
    for index, mb in enumerate(micro):
        mb_stats = ClipStats.empty(mb.response_mask.device)
        forward = first_forward if index == 0 else None
        loss, terms, metrics, kind_sums, balance = _micro_batch_loss(
            model, mb, cfg, params, normalizer, bapo_step, mb_stats, forward, digit_ids
        )
        if not math.isfinite(terms["loss"]) or not torch.isfinite(loss):
            finite = False
            break
        loss.backward()
        if kind_sums is not None:
            kind_total = kind_sums if kind_total is None else kind_total + kind_sums
        balance_total = balance if balance_total is None else balance_total + balance
        diagnostic_sums = mb_stats if diagnostic_sums is None else diagnostic_sums.add_(mb_stats)
        for name, value in terms.items():
            losses[name] = losses.get(name, 0.0) + value
        own_metrics.append(metrics)

    stepped = _step_optimizer(model, optimizer, scheduler, cfg, finite)
    out = {} if diagnostic_sums is None else {**diagnostic_sums.finalize(), **losses}
    for name in own_metrics[0] if own_metrics else ():  # a registered loss's own metrics
        out[name] = sum(metrics[name] for metrics in own_metrics) / len(own_metrics)
    if bapo_step is not None:
        out.update(bapo_step.metrics())
    if kind_total is not None:
        out.update(token_kind_metrics(kind_total, "digit"))
    if balance_total is not None:
        out.update(balance_metrics(balance_total))
    if batch.engine_log_prob is not None:  # the engine-vs-trainer gap of this update's tokens
        weights, ratio = importance_weights(batch, cfg)
        out.update(
            mismatch_metrics(
                batch.old_log_prob,
                batch.engine_log_prob,
                batch.response_mask,
                ratio,
                weights,
                cfg.rollout.correction_cap,
            )
        )
    out.update(
        {
            **stepped,
            "tokens/update": batch.tokens,
            "time/update_s": time.perf_counter() - start,
        }
    )
    if bapo_step is not None:  # the next update's rho0 from this update's entropy
        bapo_step.end(out.get("entropy", float("nan")))
    return out
