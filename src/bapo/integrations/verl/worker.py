"""BAPO's bounds per optimizer step, over the whole mini-batch and every data-parallel rank.

In verl 0.9 one optimizer step is `TrainingWorker.train_batch(mini_batch)`
(verl/workers/engine_workers.py): the engine splits the mini-batch into micro-batches and runs
forward, loss and backward on each in turn (`BaseEngine.train_batch` -> `forward_backward_batch`),
so the loss of the first micro-batch runs before the later ones have been seen. BAPO's bounds
depend on the ratios of all of them, so `BAPOTrainingWorker.train_batch` first runs a no-grad
forward of the mini-batch through the same engine (`engine.infer_batch`, the path verl's own
`compute_log_prob` takes) with a "loss" that only adds each micro-batch's ratios to a
`bapo.core.BoundStats`; then one all-reduce over the data-parallel group (`BoundStats.solve`)
gives every rank the same bounds. All of that is the run's `bapo.core.BAPOStep`
(`BAPOTrainingWorker.bapo_step`), which the worker attaches to the actor's policy-loss config
(`BAPOPolicyLossConfig.attach_step`): the registered `bapo` loss reads it from the `config`
argument verl passes it, and takes each micro-batch's bounds from `BAPOStep.bounds_for`.

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

Adaptive target (policy_loss.target_mode=entropy): the step's `EntropyTargetController`. Each
optimizer step the worker asks the engine for per-token entropy in the training forward it
already runs (calculate_entropy=True; with entropy_coeff 0 it adds nothing to the loss), the
step records it per micro-batch, and after the step one all-reduce of [sum, count] over every
rank of the worker group gives all of them the same mean entropy (replicas of a tensor- or
sequence-parallel group repeat their tokens, which leaves a mean unchanged; pipeline stages
without the loss add nothing), so every rank's controller moves the same way and the next
step's search runs with its rho0. The step's state goes next to the actor checkpoint
(`bapo_step_rank<r>.json`, bapo.integrations.step_state; see save_checkpoint). Cost: the entropy
over the vocabulary in the training forward and one small all-reduce per optimizer step.

`bapo.integrations.verl.plugin.install_worker()` makes verl's `ActorRolloutRefWorker` build this
worker as its actor (`ActorRolloutRefWorker.actor_worker_cls`, the extension point verl's own
Tinker worker uses).
With any loss other than `bapo` it behaves exactly like verl's `TrainingWorker`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.padding import no_padding_2_padding

from bapo.core import BAPOStep, SearchResult, TokenBatch
from bapo.integrations.step_state import load_step_state, save_step_state
from bapo.integrations.verl.config import BAPOPolicyLossConfig

logger = logging.getLogger(__name__)

# What the pre-pass reads from each micro-batch, besides the model's log-probs.
PROBE_FIELDS = ("response_mask", "old_log_probs", "advantages")


def observe_micro_batch(
    model_output: dict, data: TensorDict, dp_group=None, *, step: BAPOStep
) -> tuple[torch.Tensor, dict]:
    """A verl loss_function for the no-grad pre-pass: `step.observe` one micro-batch, return loss 0.

    model_output["log_probs"]: nested [B, j] over prompt + response (verl's no-padding layout);
    data: the micro-batch, with response_mask, old_log_probs, advantages ([B, T] padded or
    nested) and optionally rollout_is_weights. A token's contribution is w*|r*A| (w = its
    rollout importance weight, 1 without), the weight it has in the loss.
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)  # [B, T]
    fields = [*PROBE_FIELDS, *(["rollout_is_weights"] if "rollout_is_weights" in data else [])]
    tokens = data.select(*fields).to_padded_tensor()
    weights = tokens["rollout_is_weights"].to(log_prob.dtype) if "rollout_is_weights" in tokens else None
    old_log_prob = tokens["old_log_probs"].to(log_prob.dtype)
    step.observe(
        TokenBatch.from_log_probs(
            log_prob,
            old_log_prob,
            tokens["advantages"].to(log_prob.dtype),
            tokens["response_mask"].to(torch.bool),
            importance_weights=weights,
        )
    )
    return torch.zeros((), device=log_prob.device), {}


def record_entropy(model_output: dict, data: TensorDict, dp_group=None, *, loss_fn: Any, step: BAPOStep):
    """verl's loss_fn, plus: `step.record_entropy` of this micro-batch (model_output["entropy"]:
    nested [B, j] like the log-probs)."""
    entropy = no_padding_2_padding(model_output["entropy"], data)  # [B, T]
    step.record_entropy(entropy, data.select("response_mask").to_padded_tensor()["response_mask"])
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


def rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class BAPOTrainingWorker(TrainingWorker):
    """verl's TrainingWorker whose optimizer step first solves BAPO's bounds over the mini-batch.

    Used as the inner actor of `ActorRolloutRefWorker` (see `install`); `train_mini_batch`
    calls `train_batch` once per mini-batch. Holds the run's entropy controller (target_mode
    entropy), built on first use from the policy_loss config and saved with the checkpoint.
    """

    bapo_step: Optional[BAPOStep] = None

    def train_batch(self, data: TensorDict) -> TensorDict:
        policy_loss = bound_search_config(self.loss_fn)
        if policy_loss is None:
            return super().train_batch(data)
        step = self.step_for(policy_loss)
        if step.scope == "micro_batch" and tu.get(
            data, key="use_dynamic_bsz", default=self.engine_config.use_dynamic_bsz
        ):
            raise ValueError(
                "policy_loss.scope=micro_batch needs the same number of micro-batches on every rank, which "
                "dynamic batch sizes do not give: set actor_rollout_ref.actor.use_dynamic_bsz=False "
                "(with ppo_micro_batch_size_per_gpu) or policy_loss.scope=step"
            )
        step.begin()  # verl's engine splits the mini-batch: every step scope search runs the pre-pass
        if step.needs_pre_pass():
            self.solve_bounds(data, step)
        if step.config.target_mode != "entropy":
            try:
                return super().train_batch(data)
            finally:
                step.end()
        tu.assign_non_tensor(data, calculate_entropy=True)
        loss_fn, self.loss_fn = self.loss_fn, partial(record_entropy, loss_fn=self.loss_fn, step=step)
        try:
            output = super().train_batch(data)
        finally:
            self.loss_fn = loss_fn
        # every rank, every step: one all-reduce (see the module docstring for why over all ranks)
        step.end(device=collective_device(None))
        return output

    def step_for(self, policy_loss: BAPOPolicyLossConfig) -> BAPOStep:
        """The run's BAPOStep for `policy_loss` (built on first use, rebuilt if its config changed),
        attached to it so that the registered loss finds it."""
        config = policy_loss.bapo_config()
        if self.bapo_step is None or self.bapo_step.config != config:
            dp_group = self.engine.get_data_parallel_group()
            self.bapo_step = BAPOStep(config, device=collective_device(dp_group), process_group=dp_group)
        if policy_loss.step is not self.bapo_step:
            policy_loss.attach_step(self.bapo_step)
        return self.bapo_step

    def solve_bounds(self, data: TensorDict, step: BAPOStep) -> SearchResult:
        """The step's bounds over the mini-batch `data`: a no-grad forward through the engine,
        each micro-batch `observe`d by `step`, then one all-reduce (the same bounds on every rank)."""
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
            self.engine.infer_batch(probe, loss_function=partial(observe_micro_batch, step=step))
        return step.solve()

    # ---- the BAPO step's state next to the actor checkpoint ---------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # as TrainingWorker's, for a standalone worker group
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        """verl's checkpoint, then this rank's BAPOStep state as bapo_step_rank<r>.json in
        local_path (per rank, as FSDP's shards: a node needs no other node's files to resume)."""
        result = super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)
        if self.bapo_step is not None:
            save_step_state(local_path, rank(), self.bapo_step.state_dict())
        return result

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        """verl's checkpoint, then the BAPOStep state saved beside it (missing: a warning naming
        local_path, and the controller starts afresh; BAPOStep.load_state_dict)."""
        # read before verl may delete local_path
        state = load_step_state(local_path, rank()) if local_path is not None else None
        result = super().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        policy_loss = bound_search_config(self.loss_fn)
        if policy_loss is not None:
            self.step_for(policy_loss).load_state_dict(state, source=str(local_path))
        return result
