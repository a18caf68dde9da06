"""`bapo train CONFIG.yaml [key=value ...] [--resume RUN_DIR]`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def train_command(
    config: Optional[Path] = typer.Argument(None, help="YAML config (optional with --resume: RUN_DIR/config.yaml)"),
    overrides: Optional[List[str]] = typer.Argument(None, help="dotted overrides, e.g. loss.method=bapo offpolicy.staleness=2"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue RUN_DIR exactly from its latest checkpoint"),
) -> None:
    """Train a causal LM with GRPO / BAPO (and baselines) on verifier rewards."""
    from bapo.train import ConfigError, TrainingStopped, load_config, train
    from bapo.train.trainer import TrainingAborted, TrainingInterrupted

    overrides = list(overrides or [])
    if config is not None and "=" in config.name and not config.exists():
        overrides, config = [str(config)] + overrides, None  # `bapo train --resume DIR a.b=1`
    if config is None:
        if resume is None:
            raise typer.BadParameter("give CONFIG.yaml, or --resume RUN_DIR")
        config = resume / "config.yaml"
    if not config.exists():
        typer.echo(f"error: config file {config} not found", err=True)
        raise typer.Exit(2)
    try:
        cfg = load_config(config, overrides)
        if resume is not None:
            cfg.run.output_dir = str(resume)
        run_dir = train(cfg, resume=resume)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2)
    except (TrainingInterrupted, TrainingAborted) as err:  # SIGINT/SIGTERM: 130 / 143
        typer.echo(str(err), err=True)
        raise typer.Exit(err.exit_code)
    except TrainingStopped as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1)
    typer.echo(f"done: {run_dir} (metrics.jsonl, checkpoints/)")


def register(app) -> None:
    app.command("train", context_settings={"allow_extra_args": False})(train_command)
