"""bapo.train: the off-policy GRPO/BAPO training loop for Hugging Face causal LMs.

    from bapo.train import load_config, train
    cfg = load_config("config.yaml", overrides=["loss.method=bapo", "offpolicy.async_delay=2"])
    run_dir = train(cfg, on_update=None)

Heavy libraries (transformers, datasets) load only when a Trainer is built.
"""

from bapo.train.config import ConfigError, TrainConfig
from bapo.train.config_io import config_from_dict, load_config
from bapo.train.metrics import read_metrics
from bapo.train.rewards import Verifier, extract_answer, resolve_verifier
from bapo.train.trainer import Trainer, TrainingStopped, train

__all__ = [
    "ConfigError",
    "TrainConfig",
    "Trainer",
    "TrainingStopped",
    "Verifier",
    "config_from_dict",
    "extract_answer",
    "load_config",
    "read_metrics",
    "resolve_verifier",
    "train",
]
