"""The verl API bapo's losses were written against, checked at registration.

verl calls a registered policy loss with the arguments of its own `compute_policy_loss_vanilla`
(by keyword, from `verl.workers.utils.losses.ppo_loss`). If a verl release renames, adds or drops
one, bapo's losses would fail deep inside a Ray worker, or silently ignore a new input; instead
`check_verl_api` fails at import, naming both versions and the difference.
"""

from __future__ import annotations

import inspect
from importlib.metadata import PackageNotFoundError, version

WRITTEN_FOR = "0.9.1"  # the verl release bapo's verl integration was written and tested with
SUPPORTED = ">=0.9,<0.10"  # the pin in pyproject's `verl` extra
POLICY_LOSS_ARGS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "config",
    "rollout_is_weights",
)


class VerlVersionError(ImportError):
    """The installed verl calls policy losses with other arguments than bapo was written for."""


def installed_verl_version() -> str:
    try:
        return version("verl")
    except PackageNotFoundError:
        return "unknown"


def check_verl_api(reference=None) -> None:
    """Compare verl's `compute_policy_loss_vanilla` parameters with POLICY_LOSS_ARGS (names and order).

    reference: the function to inspect (default: the installed verl's); raises VerlVersionError."""
    if reference is None:
        from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla as reference
    found = tuple(inspect.signature(reference).parameters)
    if found != POLICY_LOSS_ARGS:
        missing = [name for name in POLICY_LOSS_ARGS if name not in found]
        new = [name for name in found if name not in POLICY_LOSS_ARGS]
        raise VerlVersionError(
            f"verl {installed_verl_version()} calls policy losses with {found}; bapo's verl losses were written for "
            f"verl {WRITTEN_FOR} ({POLICY_LOSS_ARGS}): "
            + (f"missing {missing}; " if missing else "")
            + (f"new {new}; " if new else "")
            + ("reordered; " if not missing and not new else "")
            + f"install verl{SUPPORTED} (pip install 'bapo[verl]') or update bapo.integrations.verl"
        )
