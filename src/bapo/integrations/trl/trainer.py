"""`BAPOGRPOTrainer`: TRL's `GRPOTrainer` with its clipped surrogate replaced by `bapo.core.policy_loss`.

TRL has no extension point for the surrogate (it is one branch of `GRPOTrainer._compute_loss`),
so this subclass overrides exactly that method and keeps everything else of TRL: generation,
rewards, advantages, buffering, old log-probs, the vLLM importance-sampling correction, the
KL term, logging. Shapes below: B = sequences of one micro-batch, T = completion length.

How one optimizer step goes (TRL buffers `steps_per_generation` micro-batches per generation,
serves micro-batch s from `_buffered_inputs[s % steps_per_generation]`, and accumulates
`gradient_accumulation_steps` micro-batches per optimizer step):

The BAPO protocol of each optimizer step is `bapo.core.BAPOStep` (`trainer.bapo_step`); this
class only turns TRL's buffered batches into its tensors.

1. `bapo_scope="step"`: at the first micro-batch of a step, every micro-batch of that step is
   observed and the bounds solved once (one all-reduce across ranks when torch.distributed is
   up), so BAPO's bounds see the whole step. The current ratios come from
   one no-grad forward per micro-batch, except right after a generation (TRL's old log-probs were
   computed by these weights: ratio 1) or on-policy (no old log-probs: ratio 1), where no forward runs.
   `bapo_scope="micro_batch"`: each micro-batch solves its own bounds from the forward of its
   loss (one all-reduce of the bucket sums per micro-batch; every rank runs the same number of
   micro-batches per step under accelerate), no extra forward.
2. Every micro-batch of the step then runs `policy_loss(method="bapo", bounds=those bounds)`
   with the normalizer of TRL's `loss_type`, so the summed micro-batch losses equal the loss of
   the whole step, as in TRL. At the step's last micro-batch `BAPOStep.end` feeds the entropy
   controller the step's entropy (target_mode="entropy": one all-reduce over ranks).
3. The diagnostics (`ClipStats`) of the step's micro-batches are summed, combined over ranks
   (one SUM and one MAX all-reduce) and finalized once at its last micro-batch, so the `bapo/`
   shares of a step are over all of its tokens and each step appends one value to TRL's metrics;
   so are `bapo.core.balance_sums` (bapo/response_length/{rewarded, unrewarded}, rewarded meaning
   advantage > 0 here: TRL's batch carries no rewards, and bapo/positive_share/start_bounds).

Whole prompt groups per optimizer step (`bapo_minibatch_split="groups"`, the default): TRL shuffles
the rows of a generation batch (`shuffle_sequence_dict`) before `split_tensor_dict` cuts it into
`steps_per_generation` micro-batches, so when a generation batch spans several optimizer steps a
step holds parts of groups. `_prepare_inputs` shuffles whole groups instead (a process's rows hold
whole groups when per_device_train_batch_size x steps_per_generation is a multiple of
num_generations); a run whose steps still split groups says so in one logged line.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from bapo.core import (
    BAPOStep,
    ClipStats,
    SearchResult,
    TokenBatch,
    aggregate_loss,
    balance_metrics,
    balance_sums,
    policy_loss,
)
from bapo.core.validation import per_token
from bapo.integrations.step_state import load_step_state, save_step_state
from bapo.integrations.trl.config import BAPOGRPOConfig
from bapo.train.buffer import group_rows

logger = logging.getLogger(__name__)

#: Optional (multimodal) fields of TRL's batch that its forward helper takes by the same name.
FORWARD_FIELDS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def starts_optimizer_step(trainer: GRPOTrainer, ahead: int = 0) -> bool:
    """Whether the micro-batch about to run is the first of an optimizer step, read from TRL's own
    state: `GRPOTrainer._step` counts the micro-batches already run (`training_step` increments it
    after each) and TRL closes an optimizer step when `_step % current_gradient_accumulation_steps`
    returns to 0 (its `step_time` metric). The one place that reads TRL's private counters;
    tests/integrations/test_trl_trainer.py checks it against the optimizer steps TRL takes.
    ahead: ask about the micro-batch that many after the one about to run (ahead=1 at the last
    micro-batch of a step: the next one starts a new step)."""
    return (trainer._step + ahead) % trainer.current_gradient_accumulation_steps == 0


def step_starts(per_device_batch: int, steps_per_generation: int, accumulation: int) -> list[int]:
    """The rows of a process's generation batch at which an optimizer step starts: TRL serves
    micro-batch s from chunk s % steps_per_generation (per_device_batch rows each) and a step is
    `accumulation` consecutive micro-batches. [0] when every step trains whole generation batches."""
    period = range(0, steps_per_generation * accumulation, accumulation)
    return sorted({(step % steps_per_generation) * per_device_batch for step in period})


def group_split(
    per_device_batch: int, steps_per_generation: int, accumulation: int, group_size: int, split: str
) -> str | None:
    """Why optimizer steps hold parts of prompt groups under these TRL sizes and `split`
    (bapo_minibatch_split), in one sentence; None when every step holds whole groups."""
    starts = step_starts(per_device_batch, steps_per_generation, accumulation)
    if starts == [0]:
        return None
    rows = per_device_batch * steps_per_generation
    if split == "rows":
        return (
            f"TRL shuffles the {rows} rows of each generation batch and optimizer steps start at its rows "
            f"{starts}, so steps hold parts of prompt groups (bapo_minibatch_split='groups' keeps them whole)"
        )
    if rows % group_size:
        return (
            f"a process's generation batch of {rows} completions (per_device_train_batch_size x "
            f"steps_per_generation) is not whole groups of num_generations={group_size}, so groups cannot be "
            "shuffled whole and optimizer steps hold parts of groups"
        )
    if any(start % group_size for start in starts):
        return (
            f"optimizer steps start at rows {starts} of a generation batch, not all at a group boundary "
            f"(a multiple of num_generations={group_size}), so some steps hold parts of groups: make "
            "per_device_train_batch_size x gradient_accumulation_steps a multiple of num_generations"
        )
    return None


def permute_rows(batch: dict[str, Any], order: Tensor) -> dict[str, Any]:
    """TRL's batch dict with its per-row values (tensors with a first dimension, lists) taken in
    `order` [N]; scalars (num_items_in_batch) and None stay as they are."""

    def permute(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value[order.to(value.device)] if value.dim() > 0 else value
        return None if value is None else [value[index] for index in order.tolist()]

    return {name: permute(value) for name, value in batch.items()}


def _push_through_reload_on_cpu(trainer: GRPOTrainer) -> None:
    """TRL's colocate weight sync calls vLLM's `model.load_weights`, which fails on CPU: vLLM packs
    the linear weights into oneDNN handles after loading and leaves empty Parameters without a
    weight_loader. On a CPU vLLM the sync goes through bapo.train.vllm_engine.push_weights (the
    model runner's layer-wise reload, tied LM head re-packed) instead; elsewhere TRL's stays."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or getattr(generation, "llm", None) is None:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from bapo.train.vllm_engine import push_weights

    tied = bool(getattr(trainer.model.config, "tie_word_embeddings", False))
    tied = tied and not getattr(generation, "enable_sleep_mode", False)  # (sleep mode: not on CPU)

    def sync_weights() -> None:
        weights = [(name, param.detach().clone()) for name, param in generation._iter_named_params()]
        push_weights(generation.llm, weights, tied)
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights


class BAPOGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose loss is `bapo.core.policy_loss(method=args.bapo_method)`.

    Takes the same arguments as `GRPOTrainer`; `args` must be a `BAPOGRPOConfig` (default: one
    named after the model). Logs `bapo/...` metrics (bounds, positive share, clip fractions per
    side, quadrants, ratio statistics) and `bapo/search/...` (the step's search) into TRL's log.
    """

    def __init__(self, model, reward_funcs, args: BAPOGRPOConfig | None = None, **kwargs: Any) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = BAPOGRPOConfig(f"{name.split('/')[-1]}-BAPO")
        if not isinstance(args, BAPOGRPOConfig):
            raise TypeError(f"args: expected a BAPOGRPOConfig, got {type(args).__name__}; the BAPO fields live there")
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if self.use_vllm and self.vllm_mode == "colocate":
            _push_through_reload_on_cpu(self)
        self._loss_params = args.bapo_loss_params()
        # BAPO's bounds, metrics and rho0 (fixed, or steered by each optimizer step's entropy over all ranks)
        self.bapo_step = BAPOStep(args.bapo_config()) if args.bapo_method == "bapo" else None
        # per mode: the summed diagnostics and the other metrics of this optimizer step's micro-batches so far
        self._step_diagnostics: dict[str, ClipStats] = {}
        self._step_metrics: dict[str, list[dict[str, float]]] = {}
        self._step_balance: dict[str, Tensor] = {}  # per mode: bapo.core.balance_sums of the step so far
        self._start_config = args.bapo_config()  # whose start bounds the share at the start is read at
        split_problem = group_split(
            args.per_device_train_batch_size,
            args.steps_per_generation,
            args.gradient_accumulation_steps,
            self.num_generations,
            args.bapo_minibatch_split,
        )
        local_rows = args.per_device_train_batch_size * args.steps_per_generation
        self._shuffles_groups = args.bapo_minibatch_split == "groups" and local_rows % self.num_generations == 0
        if split_problem is not None and self.accelerator.is_main_process:
            logger.warning("BAPOGRPOTrainer: %s.", split_problem)

    # ---- whole prompt groups per optimizer step (overrides GRPOTrainer._prepare_inputs) ------------------

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """TRL's, except that a new generation batch is shuffled by whole prompt groups before it is
        cut into steps_per_generation micro-batches (bapo_minibatch_split="groups"). TRL's global RNG
        draws the group order, as it draws its row order, so TRL's seed fixes it."""
        steps = self.args.steps_per_generation
        generates = self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None
        if not (self.model.training and self._shuffles_groups and generates):
            return super()._prepare_inputs(generation_batch)
        batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
        rows, group_size = len(batch["completion_ids"]), self.num_generations
        whole = rows % group_size == 0  # else not TRL's layout: TRL's own row shuffle
        order = group_rows(torch.randperm(rows // group_size), group_size) if whole else torch.randperm(rows)
        parts = split_tensor_dict(permute_rows(batch, order), steps)
        self._buffered_inputs = [unsplit_pixel_values_by_grid(part) for part in parts]
        return self._buffered_inputs[self._step % steps]

    # ---- the loss (overrides GRPOTrainer._compute_loss) -------------------------------------------------

    def _compute_loss(self, model, inputs: dict[str, Any]) -> Tensor:
        """Loss of one micro-batch, scaled so that the step's micro-batch losses add up to the step loss."""
        mode = "train" if self.model.training else "eval"
        if self.bapo_step is not None and mode == "train" and starts_optimizer_step(self):
            self._begin_bapo_step(model)  # before this forward's graph exists
        mask = self._loss_mask(inputs)
        advantages = self._advantages(inputs, mask)
        log_prob, entropy, aux_loss = self._completion_log_probs(
            model, inputs, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled
        )
        old_log_prob = self._old_log_prob(inputs, log_prob)
        if self.bapo_step is not None and mode == "train" and entropy is not None:
            self.bapo_step.record_entropy(entropy, mask)
        weights = self._token_weights(inputs, log_prob.detach(), old_log_prob, entropy, mask, advantages)
        search_batch = TokenBatch.from_log_probs(  # what BAPO's search and the balance metrics read
            log_prob.detach(), old_log_prob, advantages, mask, importance_weights=weights
        )
        self._add_balance(inputs, search_batch, mode)
        params = dict(self._loss_params)
        if self.bapo_step is not None:
            params["bounds"] = self._bapo_bounds(search_batch, mode)
        loss_agg_mode, normalizer = self._aggregation(inputs, mask, mode)
        if mode not in self._step_diagnostics:
            self._step_diagnostics[mode] = ClipStats.empty(self.accelerator.device)
        loss, metrics = policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            mask,
            self.args.bapo_method,
            loss_agg_mode=loss_agg_mode,
            normalizer=normalizer,
            importance_weights=weights,
            entropy=entropy,
            stats=self._step_diagnostics[mode],
            **params,
        )
        if self.beta != 0.0:
            kl = self._reference_kl(inputs, log_prob, old_log_prob)
            loss = loss + self.beta * aggregate_loss(kl, mask, loss_agg_mode, normalizer)
            metrics["kl_sum"], metrics["kl_tokens"] = float((kl.detach() * mask).sum()), float(mask.sum())
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation(mode)
        self._step_metrics.setdefault(mode, []).append(metrics)
        if mode == "eval" or starts_optimizer_step(self, ahead=1):  # the step's last micro-batch
            self._log_step_metrics(mode)
            if self.bapo_step is not None and mode == "train":
                self.bapo_step.end(device=self.accelerator.device)  # every rank: the next step's rho0
        return loss

    # ---- the BAPO step's state in TRL checkpoints (bapo.integrations.step_state) -------------------------

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.bapo_step is not None and os.path.isdir(folder):
            save_step_state(folder, self.accelerator.process_index, self.bapo_step.state_dict())

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.bapo_step is not None:
            state = load_step_state(resume_from_checkpoint, self.accelerator.process_index)
            self.bapo_step.load_state_dict(state, source=resume_from_checkpoint)

    # ---- the bounds of one optimizer step ----------------------------------------------------------------

    def _begin_bapo_step(self, model) -> None:
        """Start BAPO's optimizer step at its first micro-batch: scope "step" observes every
        micro-batch of the step and solves the bounds once (logged as one search)."""
        self.bapo_step.begin()  # TRL's accumulation: the micro-batch count is not known here
        if self.bapo_step.needs_pre_pass():
            self._observe_step(model, self._step_micro_batches())
            self._log_search(self.bapo_step.metrics(), "train")

    def _bapo_bounds(self, batch: TokenBatch, mode: str) -> SearchResult:
        """BAPO bounds of this micro-batch: the step's (scope "step"), or searched on this
        micro-batch from the forward just run (scope "micro_batch"; evaluation, which has no
        accumulation, always: the batch is the whole step, not recorded in the training step)."""
        alone = mode == "eval"
        found = self.bapo_step.bounds_for(batch, alone=alone)
        if alone:
            self._log_search(self.bapo_step.metrics([(found, batch.mask.to(torch.bool).sum())]), mode)
        elif self.bapo_step.scope == "micro_batch":
            self._log_search(self.bapo_step.metrics(self.bapo_step.searches[-1:]), mode)
        return found

    def _step_micro_batches(self) -> list[dict[str, Any]]:
        """TRL's buffered micro-batches of the optimizer step that starts at micro-batch `self._step`.

        Micro-batches of this step that a later generation will serve (possible only when
        gradient_accumulation_steps does not divide steps_per_generation * num_iterations) do not
        exist yet and are left out; they are generated by this step's own weights (ratio 1).
        """
        generate_every = self.args.steps_per_generation * self.num_iterations
        first = self._step
        steps = range(first, first + self.current_gradient_accumulation_steps)
        return [
            self._buffered_inputs[step % self.args.steps_per_generation]
            for step in steps
            if step // generate_every == first // generate_every
        ]

    @torch.no_grad()
    def _observe_step(self, model, micro_batches: list[dict[str, Any]]) -> None:
        """BAPOStep's pre-pass over `micro_batches`, then the step's bounds (one solve, all-reduced once).

        The share counts each token's |r*A| times TRL's per-token loss weights (vLLM IS ratio,
        off-policy mask, entropy mask), i.e. what the token contributes to the gradient.
        """
        # TRL generated (and scored old log-probs) in this very micro-batch, with these weights
        just_generated = self._step % (self.args.steps_per_generation * self.num_iterations) == 0
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for inputs in micro_batches:
                mask = self._loss_mask(inputs)
                advantages = self._advantages(inputs, mask)
                log_prob, entropy, ratio_is_one = self._search_log_probs(model, inputs, mask, just_generated)
                old_log_prob = self._old_log_prob(inputs, log_prob)
                weights = self._token_weights(inputs, log_prob, old_log_prob, entropy, mask, advantages)
                self.bapo_step.observe(
                    TokenBatch.fresh(advantages, mask, old_log_prob=old_log_prob, importance_weights=weights)
                    if ratio_is_one
                    else TokenBatch.from_log_probs(log_prob, old_log_prob, advantages, mask, importance_weights=weights)
                )
        self.bapo_step.solve()

    def _log_search(self, metrics: dict[str, float], mode: str) -> None:
        """Append bapo/search/* and bapo/target of one search to TRL's metrics (TRL averages them per logging step)."""
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)

    def _search_log_probs(
        self, model, inputs: dict[str, Any], mask: Tensor, just_generated: bool
    ) -> tuple[Tensor, Tensor | None, bool]:
        """Current log-probs [B, T] (and entropy when the entropy mask needs it) for the search,
        and whether every ratio is known to be exactly 1 (BAPOStep.observe's fresh-batch shortcut).

        No forward (unless the entropy mask needs entropies) when the answer is known: right after
        a generation TRL's old log-probs were computed by the current weights, so they are the
        current log-probs; without old log-probs TRL found the batch on-policy, every ratio is 1,
        and zeros stand for the log-probs (the old ones default to them).
        """
        needs_entropy = self.top_entropy_quantile < 1.0
        old_log_prob = inputs.get("old_per_token_logps")
        if not needs_entropy and old_log_prob is not None and just_generated:
            return old_log_prob, None, True
        if not needs_entropy and old_log_prob is None and self.off_policy_mask_threshold is None:
            return torch.zeros_like(mask, dtype=torch.float32), None, True
        log_prob, entropy, _ = self._completion_log_probs(model, inputs, compute_entropy=needs_entropy)
        return log_prob, entropy, False

    # ---- per-token tensors of TRL's batch -----------------------------------------------------------------

    def _completion_log_probs(
        self, model, inputs: dict[str, Any], compute_entropy: bool = False, compute_aux_loss: bool = False
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Log-probs [B, T] of the completion tokens under `model` (and entropy [B, T], MoE aux loss), via TRL."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        return self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=compute_entropy,
            compute_aux_loss=compute_aux_loss,
            **{name: inputs.get(name) for name in FORWARD_FIELDS},
        )

    @staticmethod
    def _loss_mask(inputs: dict[str, Any]) -> Tensor:
        """[B, T] 0/1: completion tokens that count (tool-output tokens excluded, as in TRL)."""
        mask = inputs["completion_mask"]
        return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask

    @staticmethod
    def _advantages(inputs: dict[str, Any], mask: Tensor) -> Tensor:
        """[B, T] advantages (TRL gives [B], or [B, T] from subclasses)."""
        return per_token(inputs["advantages"], mask).float()

    @staticmethod
    def _old_log_prob(inputs: dict[str, Any], log_prob: Tensor) -> Tensor:
        """[B, T] behaviour log-probs; TRL leaves them out when the batch is on-policy (ratio exactly 1)."""
        old_log_prob = inputs.get("old_per_token_logps")
        return log_prob.detach() if old_log_prob is None else old_log_prob

    def _token_weights(
        self,
        inputs: dict[str, Any],
        log_prob: Tensor,
        old_log_prob: Tensor,
        entropy: Tensor | None,
        mask: Tensor,
        advantages: Tensor,
    ) -> Tensor | None:
        """[B, T] detached multipliers TRL applies to the per-token loss, or None when there are none.

        vLLM importance-sampling correction ([B, T] token modes, [B, 1] sequence modes), the
        off-policy sequence mask (off_policy_mask_threshold) and the top-entropy mask.
        """
        factors = []
        if self.use_vllm and self.vllm_importance_sampling_correction:
            factors.append(inputs["importance_sampling_ratio"])
        if self.off_policy_mask_threshold is not None:
            factors.append(
                self.get_off_policy_mask(
                    advantages=advantages[:, :1],
                    per_token_logps=log_prob,
                    sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_log_prob),
                    mask=mask,
                    off_policy_threshold=self.off_policy_mask_threshold,
                )
            )
        if self.top_entropy_quantile < 1.0:
            factors.append(self.get_high_entropy_mask(entropy, mask, 1 - self.top_entropy_quantile))
        if not factors:
            return None
        weights = factors[0]
        for factor in factors[1:]:
            weights = weights * factor
        return weights.detach().float().expand_as(mask)

    def _reference_kl(self, inputs: dict[str, Any], log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
        """[B, T] k3 estimate of KL(current || reference), as TRL's beta term (optionally IS-corrected)."""
        log_ratio_to_reference = inputs["ref_per_token_logps"] - log_prob
        kl = torch.exp(log_ratio_to_reference) - log_ratio_to_reference - 1
        if self.args.use_bias_correction_kl:
            kl = kl * torch.exp(log_prob - old_log_prob)
        return kl

    # ---- aggregation and logging --------------------------------------------------------------------------

    def _accumulation(self, mode: str) -> int:
        """Micro-batches the loss is accumulated over (1 in evaluation)."""
        return self.current_gradient_accumulation_steps if mode == "train" else 1

    def _aggregation(self, inputs: dict[str, Any], mask: Tensor, mode: str) -> tuple[str, float]:
        """(loss_agg_mode, normalizer) of TRL's loss_type: the mode from LOSS_TYPE_TO_AGG_MODE (via the
        config), the normalizer as TRL computes it, with its gradient-accumulation scaling folded in."""
        accumulation = self._accumulation(mode)
        if self.loss_type == "dapo":  # tokens per optimizer step and process, as TRL computes them
            normalizer = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
        elif self.loss_type == "bnpo":  # tokens of the local micro-batch
            normalizer = float(mask.sum().clamp(min=1.0)) * accumulation
        elif self.loss_type == "grpo":  # sequences
            normalizer = float(mask.size(0) * accumulation)
        else:  # dr_grpo: sequences x max_completion_length
            normalizer = float(mask.size(0) * self.max_completion_length * accumulation)
        return self.args.bapo_loss_agg_mode, normalizer

    def _add_balance(self, inputs: dict[str, Any], batch: TokenBatch, mode: str) -> None:
        """Add this micro-batch's bapo.core.balance_sums to the step's; a completion counts as
        rewarded when its advantage is > 0 (TRL's batch has advantages, not rewards)."""
        sequence_advantage = inputs["advantages"] if inputs["advantages"].dim() == 1 else inputs["advantages"][:, 0]
        sums = balance_sums(batch, sequence_advantage > 0, self._start_config)
        self._step_balance[mode] = sums if mode not in self._step_balance else self._step_balance[mode] + sums

    def _log_step_metrics(self, mode: str) -> None:
        """Append one optimizer step's `bapo/<name>` values to TRL's metrics (TRL averages them per logging step).

        The diagnostics are the step's `ClipStats` summed over its micro-batches and ranks, then
        finalized: shares over all of the step's tokens (a micro-batch without signal adds nothing
        instead of a NaN). `loss` is the sum of the micro-batch losses (the step's loss), the
        method's own metrics the mean over micro-batches, `kl` the mean over the step's tokens;
        these are averaged over ranks.
        """
        diagnostics = self._step_diagnostics.pop(mode)
        micro_batches = self._step_metrics.pop(mode)
        balance = self._step_balance.pop(mode)
        if self.accelerator.num_processes > 1:
            diagnostics.all_reduce()
            balance = self.accelerator.reduce(balance, reduction="sum")
        local = {"loss": sum(metrics["loss"] for metrics in micro_batches)}
        for name in micro_batches[0]:
            if name not in ("loss", "kl_sum", "kl_tokens"):
                local[name] = sum(metrics[name] for metrics in micro_batches) / len(micro_batches)
        if "kl_sum" in micro_batches[0]:
            tokens = sum(metrics["kl_tokens"] for metrics in micro_batches)
            local["kl"] = sum(metrics["kl_sum"] for metrics in micro_batches) / max(tokens, 1.0)
        self._log_bapo_metrics(mode, local, {**diagnostics.finalize(), **balance_metrics(balance)})

    def _log_bapo_metrics(self, mode: str, local: dict[str, float], combined: dict[str, float]) -> None:
        """Append `bapo/<name>` to TRL's metrics: `local` values averaged over ranks, `combined` ones
        (already over all ranks) as they are. `entropy` and `kl` also go under TRL's own names, so
        TRL dashboards keep working.
        """
        names = list(local)
        values = [local[name] for name in names]
        if self.accelerator.num_processes > 1:  # one collective for all of them
            stacked = torch.tensor(values, device=self.accelerator.device)
            values = self.accelerator.reduce(stacked, reduction="mean").tolist()
        names += list(combined)
        values += list(combined.values())
        for name, value in zip(names, values):
            self._metrics[mode][name if name.startswith("bapo/") else f"bapo/{name}"].append(value)
            if name in ("entropy", "kl"):
                self._metrics[mode][name].append(value)
