"""bapo inside verl 0.9: bapo.core losses verl lacks as verl policy losses, BAPO bounds per optimizer step.

Importing this module registers VERL_LOSSES (bapo, topr, dcpo, m2po, m2po-official) in verl's
policy-loss registry (verl imports it in every process through the `verl.plugins` entry point,
and Hydra imports it when it builds `BAPOPolicyLossConfig`). Select a loss and its parameters in verl's config:

    actor_rollout_ref.actor.policy_loss._target_=bapo.integrations.verl.BAPOPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=bapo        # or topr, dcpo
    +actor_rollout_ref.actor.policy_loss.target=0.5           # any BAPOConfig field, see config.py

With that config every actor worker solves BAPO's bounds once per optimizer step over the
whole mini-batch and all data-parallel ranks (`worker.BAPOTrainingWorker`; policy_loss.scope=micro_batch:
per micro-batch, no extra forward); the search's metrics appear as actor/bapo/search/{lower, upper,
share, pos_neg, reached, steps, scope, tokens}, the step's rho0 as actor/bapo/target (steered by the
worker's entropy controller under policy_loss.target_mode=entropy), the loss's diagnostics as
actor/bapo/..., next to verl's own.
Layout: `config` (the dataclass), `losses` (verl-signature losses over bapo.core), `plugin`
(registration, the import hook that installs the worker), `worker` (`BAPOTrainingWorker`, the
adapter from verl's batches to `bapo.core.BAPOStep`; it imports verl's worker stack: Ray,
FastAPI, uvicorn). This module imports only verl's loss registry and configs.
"""

from bapo.integrations.verl.config import BAPOPolicyLossConfig
from bapo.integrations.verl.losses import VERL_LOSSES, core_aggregation, make_verl_loss, register_verl_losses
from bapo.integrations.verl.plugin import install_plugin

install_plugin()  # the losses now; the bound-search worker once verl's worker module loads

__all__ = ["BAPOPolicyLossConfig", "VERL_LOSSES", "core_aggregation", "make_verl_loss", "register_verl_losses"]
