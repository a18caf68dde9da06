"""`bapo train [CONFIG.yaml] [key=value ...] [--resume RUN_DIR] [--print-config]`."""

from __future__ import annotations

from pathlib import Path

import typer

from bapo.cli.errors import user_errors


def split_arguments(arguments: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG.yaml] key=value ... -> (config file or None, overrides). The file, when given,
    comes first; every other argument must be key=value."""
    from bapo.train import ConfigError

    config, overrides = None, list(arguments)
    if overrides and "=" not in overrides[0]:
        config, overrides = overrides[0], overrides[1:]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"argument {item!r} is not key=value: give the config file first, then "
                "dotted overrides such as loss.method=bapo"
            )
    return config, overrides


def train_command(
    arguments: list[str] | None = typer.Argument(
        None,
        metavar="[CONFIG.yaml] [KEY=VALUE]...",
        help="a YAML config (optional: with --resume it is RUN_DIR/config.yaml) and dotted overrides, "
        "e.g. loss.method=bapo offpolicy.async_delay=2",
    ),
    resume: Path | None = typer.Option(None, "--resume", help="continue RUN_DIR exactly from its latest checkpoint"),
    print_config: bool = typer.Option(
        False, "--print-config", help="print the resolved config (every key, default, meaning) and exit"
    ),
) -> None:
    """Train a causal LM with GRPO / BAPO (and baselines) on verifier rewards."""
    from bapo.train import TrainingStopped, load_config, train
    from bapo.train.config_io import describe_config, load_run_config
    from bapo.train.trainer import TrainingAborted, TrainingInterrupted

    with user_errors():
        config, overrides = split_arguments(list(arguments or []))
        if print_config:
            typer.echo(describe_config(config, overrides), nl=False)
            return
        if config is None and resume is not None:
            cfg = load_run_config(resume, overrides)
        else:
            cfg = load_config(config, overrides)
        if resume is not None:
            cfg.run.output_dir = str(resume)
        try:
            run_dir = train(cfg, resume=resume)
        except (TrainingInterrupted, TrainingAborted) as err:  # SIGINT/SIGTERM: 130 / 143
            typer.echo(str(err), err=True)
            raise typer.Exit(err.exit_code) from None
        except TrainingStopped as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1) from None
    typer.echo(f"done: {run_dir} (metrics.jsonl, checkpoints/)")


def register(app) -> None:
    app.command("train")(train_command)
