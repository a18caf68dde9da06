"""BAPO's bounds per optimizer step, over the whole mini-batch and every data-parallel rank.

In verl 0.9 one optimizer step is `TrainingWorker.train_batch(mini_batch)`
(verl/workers/engine_workers.py): the engine splits the mini-batch into micro-batches and runs
forward, loss and backward on each in turn (`BaseEngine.train_batch` -> `forward_backward_batch`),
so the loss of the first micro-batch runs before the later ones have been seen. BAPO's bounds
depend on the ratios of all of them, so `BAPOTrainingWorker.train_batch` first runs a no-grad
forward of the mini-batch through the same engine (`engine.infer_batch`, the path verl's own
`compute_log_prob` takes) with a "loss" that only adds each micro-batch's ratios to a
`bapo.core.BoundStats`; then one all-reduce over the data-parallel group (`BoundStats.solve`)
gives every rank the same bounds, which the registered `bapo` loss reads from the context
variable `config.step_bounds()` that `train_batch` sets around the real step.

With `policy_loss.scope=micro_batch` there is no pre-pass: each micro-batch's loss solves its own
bounds from the forward it runs, with one all-reduce of the bucket sums per micro-batch over the
data-parallel group. That is rank-consistent only if every rank runs the same number of
micro-batches, which verl's dynamic batch size does not guarantee: that combination is refused.

Collectives: bapo adds one all-reduce per mini-batch, issued after the pre-pass, and nothing per
micro-batch. Every rank runs the same number of mini-batches (verl gives each the same per-rank
mini-batch size) while micro-batch counts may differ (dynamic batch sizes). The pre-pass also
runs the engine's own once-per-call collectives (global token count; with dynamic batch sizes,
FSDP's micro-batch count), as verl's compute_log_prob does. Cost: one extra forward without
grad per mini-batch, with verl's log-prob micro-batch sizes.

Adaptive target (policy_loss.target_mode=entropy): the worker owns the run's
`EntropyTargetController`. Each optimizer step it asks the engine for per-token entropy in the
training forward it already runs (calculate_entropy=True; with entropy_coeff 0 it adds nothing to
the loss), sums it over the step's micro-batches, and after the step one all-reduce of
[sum, count] over every rank of the worker group gives all of them the same mean entropy
(replicas of a tensor- or sequence-parallel group repeat their tokens, which leaves a mean
unchanged; pipeline stages without the loss add nothing), so every rank's controller moves the
same way and the next step's search runs with its rho0. Its state goes next to the actor
checkpoint (`bapo_target_rank<r>.json`, see save_checkpoint). Cost: the entropy over the
vocabulary in the training forward and one small all-reduce per optimizer step.

`install()` makes verl's `ActorRolloutRefWorker` build this worker as its actor
(`ActorRolloutRefWorker.actor_worker_cls`, the extension point verl's own Tinker worker uses).
With any loss other than `bapo` it behaves exactly like verl's `TrainingWorker`.
"""

from __future__ import annotations

import json
import logging
import os
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
from verl.workers.utils.padding import no_padding_2_padding

from bapo.core import BAPOConfig, BoundStats, SearchResult, token_ratio
from bapo.core.target import EntropyTargetController, token_mean_over_ranks
from bapo.integrations.verl.config import BAPOPolicyLossConfig, StepBounds, optimizer_step_bounds

logger = logging.getLogger(__name__)

# What the pre-pass reads from each micro-batch, besides the model's log-probs.
PROBE_FIELDS = ("response_mask", "old_log_probs", "advantages")


def add_bound_stats(
    model_output: dict, data: TensorDict, dp_group=None, *, stats: BoundStats, token_counts: list[int] | None = None
) -> tuple[torch.Tensor, dict]:
    """A verl loss_function for the no-grad pre-pass: add one micro-batch to `stats`, return loss 0.

    model_output["log_probs"]: nested [B, j] over prompt + response (verl's no-padding layout);
    data: the micro-batch, with response_mask, old_log_probs, advantages ([B, T] padded or
    nested) and optionally rollout_is_weights. A token's contribution is w*|r*A| (w = its
    rollout importance weight, 1 without), the weight it has in the loss.
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)  # [B, T]
    fields = [*PROBE_FIELDS, *(["rollout_is_weights"] if "rollout_is_weights" in data else [])]
    tokens = data.select(*fields).to_padded_tensor()
    weights = tokens["rollout_is_weights"].to(log_prob.dtype) if "rollout_is_weights" in tokens else None
    ratio = token_ratio(log_prob, tokens["old_log_probs"].to(log_prob.dtype))
    stats.add(
        ratio,
        tokens["advantages"].to(log_prob.dtype),
        tokens["response_mask"].to(torch.bool),
        weights=weights,
        behaviour_log_prob=tokens["old_log_probs"].to(log_prob.dtype),
    )
    if token_counts is not None:
        token_counts.append(int(tokens["response_mask"].sum()))
    return torch.zeros((), device=log_prob.device), {}


def add_entropy(
    model_output: dict, data: TensorDict, dp_group=None, *, loss_fn: Any, entropy_sums: list[float]
) -> tuple[torch.Tensor, dict]:
    """verl's loss_fn, plus: add this micro-batch's masked entropy sum and token count to
    `entropy_sums` ([sum, count]). model_output["entropy"]: nested [B, j] like the log-probs."""
    entropy = no_padding_2_padding(model_output["entropy"], data).detach()  # [B, T]
    mask = data.select("response_mask").to_padded_tensor()["response_mask"].to(entropy.dtype)
    entropy_sums[0] += float((entropy * mask).sum())
    entropy_sums[1] += float(mask.sum())
    return loss_fn(model_output=model_output, data=data, dp_group=dp_group)


def collective_device(group) -> torch.device:
    """Where a tensor must live for a collective on `group` (CPU for gloo, the accelerator else)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from verl.utils.device import get_device_id, get_device_name

    return torch.device(get_device_name(), get_device_id())


def bound_search_config(loss_fn: Any) -> Optional[BAPOPolicyLossConfig]:
    """The BAPO policy-loss config behind verl's actor loss_fn (partial(ppo_loss, config=ActorConfig)),
    when its loss needs bounds over the whole mini-batch; None otherwise."""
    actor_config = getattr(loss_fn, "keywords", {}).get("config")
    policy_loss = getattr(actor_config, "policy_loss", None)
    if isinstance(policy_loss, BAPOPolicyLossConfig) and policy_loss.searches_bounds:
        return policy_loss
    return None


class BAPOTrainingWorker(TrainingWorker):
    """verl's TrainingWorker whose optimizer step first solves BAPO's bounds over the mini-batch.

    Used as the inner actor of `ActorRolloutRefWorker` (see `install`); `train_mini_batch`
    calls `train_batch` once per mini-batch. Holds the run's entropy controller (target_mode
    entropy), built on first use from the policy_loss config and saved with the checkpoint.
    """

    bapo_target: Optional[EntropyTargetController] = None

    def train_batch(self, data: TensorDict) -> TensorDict:
        policy_loss = bound_search_config(self.loss_fn)
        if policy_loss is None:
            return super().train_batch(data)
        dp_group = self.engine.get_data_parallel_group()
        target = self.target_controller(policy_loss)
        search_config = target.search_config()
        if policy_loss.scope == "micro_batch":
            if tu.get(data, key="use_dynamic_bsz", default=self.engine_config.use_dynamic_bsz):
                raise ValueError(
                    "policy_loss.scope=micro_batch needs the same number of micro-batches on every rank, which "
                    "dynamic batch sizes do not give: set actor_rollout_ref.actor.use_dynamic_bsz=False "
                    "(with ppo_micro_batch_size_per_gpu) or policy_loss.scope=step"
                )
            bounds = StepBounds("micro_batch", process_group=dp_group, config=search_config)
        else:
            solved, tokens = self.solve_bounds(data, search_config)
            bounds = StepBounds("step", solved=solved, tokens=tokens, config=search_config)
        if search_config.target_mode != "entropy":
            with optimizer_step_bounds(bounds):
                return super().train_batch(data)
        entropy_sums = [0.0, 0.0]
        tu.assign_non_tensor(data, calculate_entropy=True)
        loss_fn, self.loss_fn = self.loss_fn, partial(add_entropy, loss_fn=self.loss_fn, entropy_sums=entropy_sums)
        try:
            with optimizer_step_bounds(bounds):
                output = super().train_batch(data)
        finally:
            self.loss_fn = loss_fn
        # every rank, every step: one all-reduce (see the module docstring for why over all ranks)
        target.update(token_mean_over_ranks(*entropy_sums, device=collective_device(None)))
        return output

    def target_controller(self, policy_loss: BAPOPolicyLossConfig) -> EntropyTargetController:
        """The run's controller (fixed mode: one that keeps policy_loss's rho0)."""
        config = policy_loss.bapo_config()
        if self.bapo_target is None or self.bapo_target.config != config:
            self.bapo_target = EntropyTargetController(config)
        return self.bapo_target

    def solve_bounds(self, data: TensorDict, config: BAPOConfig) -> tuple[SearchResult, int]:
        """No-grad forward of the mini-batch `data`, then one all-reduce: bounds under `config` (the
        same on every rank), and the tokens of this rank the search saw."""
        dp_group = self.engine.get_data_parallel_group()
        stats = BoundStats(config, device=collective_device(dp_group))
        probe = data.copy()  # shallow: the engine writes its batch info here, not into `data`
        # The engine settings verl's own log-prob forward (TrainingWorker.infer_batch) uses;
        # keys the trainer already set on the mini-batch win. No entropy or distillation outputs.
        defaults = dict(
            use_remove_padding=self.model_config.get("use_remove_padding", False),
            use_dynamic_bsz=self.engine_config.use_dynamic_bsz,
            max_token_len_per_gpu=self.engine_config.infer_max_token_len_per_gpu,
            micro_batch_size_per_gpu=self.engine_config.infer_micro_batch_size_per_gpu,
            use_fused_kernels=self.engine_config.use_fused_kernels,
        )
        tu.assign_non_tensor(probe, **{key: value for key, value in defaults.items() if key not in data})
        tu.assign_non_tensor(probe, calculate_entropy=False, distillation_use_topk=False)
        disable_auto_offload = tu.get(data, key="disable_auto_offload", default=False)
        with self.engine.train_mode(disable_auto_offload=disable_auto_offload):
            token_counts: list[int] = []
            self.engine.infer_batch(
                probe, loss_function=partial(add_bound_stats, stats=stats, token_counts=token_counts)
            )
        return stats.solve(process_group=dp_group), sum(token_counts)

    # ---- the adaptive target's state next to the actor checkpoint ---------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # as TrainingWorker's, for a standalone worker group
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        """verl's checkpoint, then this rank's controller state as bapo_target_rank<r>.json in
        local_path (per rank, as FSDP's shards: a node needs no other node's files to resume)."""
        result = super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)
        if self.bapo_target is not None and self.bapo_target.config.target_mode == "entropy":
            path = target_state_path(local_path)
            os.makedirs(local_path, exist_ok=True)
            with open(path + ".tmp", "w") as file:
                json.dump(self.bapo_target.state_dict(), file)
            os.replace(path + ".tmp", path)  # a kill mid-write leaves the previous file whole
        return result

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        """verl's checkpoint, then the controller state saved beside it (target_mode entropy)."""
        path = target_state_path(local_path) if local_path is not None else None
        state = None
        if path is not None and os.path.exists(path):  # read before verl may delete local_path
            with open(path) as file:
                state = json.load(file)
        result = super().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        policy_loss = bound_search_config(self.loss_fn)
        if policy_loss is not None and policy_loss.target_mode == "entropy":
            if state is None:
                logger.warning(
                    "bapo: %s has no entropy-controller state (saved by a run with target_mode=fixed or "
                    "before bapo saved it); the controller starts afresh from policy_loss.target",
                    local_path,
                )
            else:
                self.target_controller(policy_loss).load_state_dict(state)
        return result


def target_state_path(local_path: str) -> str:
    """Where BAPOTrainingWorker keeps this rank's controller state in a checkpoint directory."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return os.path.join(local_path, f"bapo_target_rank{rank}.json")


def install() -> None:
    """Make verl's ActorRolloutRefWorker build a BAPOTrainingWorker as its actor (idempotent).

    Leaves a worker class someone else installed in place (with a warning): then the bounds are
    searched per micro-batch.
    """
    current = ActorRolloutRefWorker.actor_worker_cls
    if issubclass(current, BAPOTrainingWorker):
        return
    if current is not TrainingWorker:
        logger.warning(
            "bapo: ActorRolloutRefWorker.actor_worker_cls is %s, not verl's TrainingWorker; "
            "leaving it, so BAPO bounds are searched per micro-batch",
            current.__qualname__,
        )
        return
    ActorRolloutRefWorker.actor_worker_cls = BAPOTrainingWorker
