"""BAPO (and every `bapo.core` loss) inside TRL's `GRPOTrainer`.

    from bapo.integrations.trl import BAPOGRPOConfig, BAPOGRPOTrainer
    args = BAPOGRPOConfig(output_dir="out", bapo_method="bapo", bapo_target=0.4,
                          steps_per_generation=8, gradient_accumulation_steps=2)
    trainer = BAPOGRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=my_reward,
                              args=args, train_dataset=dataset)
    trainer.train()

`pip install "bapo[trl]"`. Tested with trl 1.9.2, 1.10, 1.12, 1.13, 1.14.2 and 1.16.0 (1.15.0's
GRPOTrainer itself needs Triton for its log-prob kernel, so it was not run on CPU). The subclass
overrides the private `GRPOTrainer._compute_loss` and reads TRL's buffering internals, which TRL
may change in any minor release, so versions outside TESTED_TRL warn at import. Before 1.9,
TRL's "dapo" normalizer spanned the whole generation batch; bapo follows the 1.9+ formula.
"""

from __future__ import annotations

import warnings

try:
    import trl
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError('bapo.integrations.trl needs TRL: pip install "bapo[trl]"') from error

from packaging.version import Version

#: TRL versions this integration was tested with: [lowest, first untested).
TESTED_TRL = ("1.9.2", "1.17.0")

if not Version(TESTED_TRL[0]) <= Version(trl.__version__) < Version(TESTED_TRL[1]):
    warnings.warn(
        f"bapo.integrations.trl was tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}, found {trl.__version__}; "
        "it overrides GRPOTrainer._compute_loss and reads GRPOTrainer's buffering internals, so check the loss "
        "(tests/integrations/test_trl_trainer.py) before trusting it",
        stacklevel=2,
    )

from bapo.integrations.trl.config import LOSS_TYPE_TO_AGG_MODE, BAPOGRPOConfig  # noqa: E402
from bapo.integrations.trl.trainer import BAPOGRPOTrainer  # noqa: E402

__all__ = ["BAPOGRPOConfig", "BAPOGRPOTrainer", "LOSS_TYPE_TO_AGG_MODE", "TESTED_TRL"]
