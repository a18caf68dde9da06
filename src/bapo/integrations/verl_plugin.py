"""verl's plugin entry point for bapo (`verl.plugins` in pyproject.toml): imports
bapo.integrations.verl, which registers bapo's losses. verl 0.9 imports every plugin at `import
verl` and logs a failing one at DEBUG only, so a broken install would just make `loss_mode=bapo`
unknown later; this reports the failure at ERROR (shown without any logging set-up) first."""

import logging

try:
    import bapo.integrations.verl  # noqa: F401  (registers the losses, the worker hook, the bypass guard)
except Exception as err:
    logging.getLogger("bapo").error(
        "bapo's verl plugin failed to load (%s: %s): its losses (bapo, topr, dcpo, m2po, m2po-official) are "
        "not registered; check that bapo[verl] is installed in this environment",
        type(err).__name__,
        err,
    )
    raise
