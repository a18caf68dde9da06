"""bapo's runtime wiring into verl: the losses in verl's registry and BAPOTrainingWorker as the actor.

`install_plugin()` runs when `bapo.integrations.verl` is imported (verl imports it in every
process through the `verl.plugins` entry point). It registers the losses at once and installs the
worker now when verl's worker module is loaded, else right after it is first imported (an import
hook on `sys.meta_path`): the worker module imports verl's whole worker stack (Ray, FastAPI,
uvicorn), which this module must not load by itself.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys

from bapo.integrations.verl.losses import VERL_LOSSES, register_verl_losses

logger = logging.getLogger(__name__)

WORKER_MODULE = "verl.workers.engine_workers"


def install_worker() -> None:
    """Make verl's ActorRolloutRefWorker build a BAPOTrainingWorker as its actor (idempotent).

    Leaves a worker class someone else installed in place (with a warning): then the bounds are
    searched per micro-batch.
    """
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from bapo.integrations.verl.worker import BAPOTrainingWorker

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


class _InstallAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `install_worker()` right after verl's worker module has been imported (one shot)."""

    def find_spec(self, name, path, target=None):
        if name != WORKER_MODULE:
            return None
        sys.meta_path.remove(self)  # find the real module below us, and never fire twice
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self.real_loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.real_loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.real_loader.exec_module(module)
        install_worker()


def install_worker_hook() -> None:
    """Make verl's actor workers build `BAPOTrainingWorker`: now when verl's worker module is
    loaded, else right after it is first imported. Imports nothing heavy itself."""
    if WORKER_MODULE in sys.modules:
        install_worker()
    elif not any(isinstance(finder, _InstallAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())


def guard_bypass_mode() -> None:
    """Refuse verl's bypass mode with a bapo loss (idempotent). With
    algorithm.rollout_correction.bypass_mode=True (verl's recommended mode) the driver's
    `rollout_corr_helper.apply_bypass_mode` rewrites the actor's policy_loss.loss_mode to
    'bypass_mode', so bapo's loss would silently be replaced by verl's PPO-clip; the driver calls it
    through the module attribute, which this wraps."""
    from verl.trainer.ppo import rollout_corr_helper

    original = rollout_corr_helper.apply_bypass_mode
    if getattr(original, "bapo_guard", False):
        return

    @functools.wraps(original)
    def apply_bypass_mode(batch, rollout_corr_config=None, policy_loss_config=None):
        loss_mode = policy_loss_config.get("loss_mode") if policy_loss_config is not None else None
        if loss_mode in VERL_LOSSES:
            raise ValueError(
                f"algorithm.rollout_correction.bypass_mode=True would replace actor_rollout_ref.actor.policy_loss."
                f"loss_mode={loss_mode} by verl's bypass_mode loss (PPO-clip): set "
                "algorithm.rollout_correction.bypass_mode=False (decoupled mode: bapo's loss runs, with verl's "
                "rollout-correction weights)"
            )
        return original(batch, rollout_corr_config=rollout_corr_config, policy_loss_config=policy_loss_config)

    apply_bypass_mode.bapo_guard = True  # type: ignore[attr-defined]
    rollout_corr_helper.apply_bypass_mode = apply_bypass_mode


def install_plugin() -> None:
    """Register bapo's verl losses, refuse bypass mode for them and install the worker hook (what
    importing bapo.integrations.verl does)."""
    register_verl_losses()
    guard_bypass_mode()
    install_worker_hook()
