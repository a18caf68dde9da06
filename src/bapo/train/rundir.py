"""The run directory's rules: one writer at a time, and what a resume may change.

RunLock: an exclusive advisory lock (fcntl.flock) on RUN_DIR/.lock, held by the one process that
writes the run (fresh start or resume). The kernel drops it when that process dies, so a lock
left by a killed run never blocks; a live holder makes the second process fail at once with
its pid.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from bapo.train.checkpoint import checkpoints
from bapo.train.config import ConfigError, TrainConfig
from bapo.train.config_io import upgrade_run_config

LOCK_FILE = ".lock"

# Dotted config fields (or section prefixes) that may differ between a run and its --resume:
# they change how long, how often or where it is recorded, not what it computes.
RESUMABLE_FIELDS = (
    "run.rollout_steps",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.save_optimizer",
    "run.max_nonfinite",
    "run.divergence",
    "run.tensorboard",
    "run.progress",
    "run.output_dir",
    "run.overwrite",
    "reward.timeout_s",
    "model.device",
    "rollout.logprob_batch_size",
)


class RunLock:
    """Holds RUN_DIR/.lock exclusively until `release()` (or the process's death)."""

    def __init__(self, run_dir: Path):
        import fcntl

        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self.lock_fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.lock_fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.lock_fd)
            self.lock_fd = None
            raise ConfigError(
                f"run directory {str(run_dir)!r} is in use by another bapo process (pid {holder}); "
                "wait for it to finish or use another run.output_dir"
            ) from None
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # closing the descriptor drops the flock
            self.lock_fd = None

    def __del__(self) -> None:
        self.release()


def holds_run(run_dir: Path) -> bool:
    """True when a fresh start would overwrite something: metrics or a checkpoint."""
    return (run_dir / "metrics.jsonl").exists() or bool(checkpoints(run_dir))


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value and key != "params":
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def check_resume_config(run_dir: Path, cfg: TrainConfig) -> None:
    """Refuse a resume whose config differs from the run's own config.yaml in a field that changes
    what the run computes (async delay, mini-batches, mode, group size, method, lr, ...), naming the field."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists():
        raise ConfigError(
            f"--resume {run_dir}: config.yaml is missing, so the run's settings cannot be checked; "
            "restore it or start a new run"
        )
    # a run written before a key was renamed (run.steps, offpolicy.staleness) is compared under the new
    # name, and before a key was added (offpolicy.minibatch_split) with the value it ran with
    saved = _flatten(upgrade_run_config(yaml.safe_load(saved_path.read_text()) or {}))
    now = _flatten(cfg.model_dump(mode="json"))
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key) and not key.startswith(RESUMABLE_FIELDS):
            raise ConfigError(
                f"--resume {run_dir}: {key} was {saved.get(key)!r} in this run, now {now.get(key)!r}; it changes "
                "what the run computes, so it cannot continue exactly: drop the override or start a new run. "
                f"Fields that may change on resume: {', '.join(RESUMABLE_FIELDS)}"
            )
