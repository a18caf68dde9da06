"""`bapo eval`: avg@k and pass@k of a model (or a training run's latest checkpoint) on a JSONL file,
with the run's own prompt format and sampling settings unless told otherwise."""

from __future__ import annotations

from pathlib import Path

import typer

from bapo.cli.errors import user_errors


def resolve_model(model: str) -> tuple[str, Path | None]:
    """--model: a run directory -> (its latest checkpoint's model folder, RUN_DIR/config.yaml);
    a checkpoint directory -> its model folder; anything else (a model folder, a hub id) as is."""
    from bapo.train import ConfigError
    from bapo.train.checkpoint import latest_checkpoint

    path = Path(model).expanduser()
    if (path / "checkpoints").is_dir():
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise ConfigError(
                f"--model {model}: the run has no checkpoint yet under {path / 'checkpoints'}; "
                "wait for run.checkpoint_every, or give a model folder"
            )
        config = path / "config.yaml"
        return str(checkpoint / "model"), config if config.exists() else None
    if (path / "model" / "config.json").exists():  # a checkpoint directory
        return str(path / "model"), None
    return model, None


def evaluate_command(
    model: str = typer.Option(
        ..., "--model", help="a run directory (its latest checkpoint), a model folder or a hub id"
    ),
    data: Path = typer.Option(
        ..., "--data", help="JSONL of {prompt, answer} (keys: the config's data.prompt_key/answer_key)"
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="a training config (default RUN_DIR/config.yaml): prompt format, sampling and verifier as in training",
    ),
    k: int = typer.Option(8, "--k", help="samples per prompt"),
    verifier: str | None = typer.Option(
        None,
        "--verifier",
        help="auto | demo | math | exact | pkg.module:attr (default: the config's reward.verifier, else auto)",
    ),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="default: the config's, else 48"),
    temperature: float | None = typer.Option(None, "--temperature", help="0 = greedy; default: the config's, else 1"),
    top_p: float | None = typer.Option(None, "--top-p", help="default: the config's, else 1"),
    top_k: int | None = typer.Option(None, "--top-k", help="default: the config's, else 0 (off)"),
    chat: bool | None = typer.Option(None, "--chat/--no-chat", help="chat template (default: the config's)"),
    system_prompt: str | None = typer.Option(None, "--system-prompt", help="default: the config's"),
    seed: int = typer.Option(0, "--seed", help="sampling seed"),
    batch_size: int = typer.Option(256, "--batch-size", help="sequences per generate call"),
    limit: int | None = typer.Option(None, "--limit", help="first N rows only"),
    device: str = typer.Option("auto", "--device"),
):
    """avg@k and pass@k of a model on a JSONL file (batched sampling); prints one JSON line."""
    import json

    with user_errors():
        from bapo.train import ConfigError, load_config
        from bapo.train.config import DataSection
        from bapo.train.config_io import load_run_config
        from bapo.train.data import load_examples
        from bapo.train.trainer import check_model_path

        model_path, run_config = resolve_model(model)
        cfg = load_config(config) if config else load_run_config(run_config.parent) if run_config else None
        try:
            check_model_path(model_path)
        except ConfigError as err:
            raise ConfigError(str(err).replace("model.path=", "--model ")) from None
        section = DataSection(
            path=str(data), **({"prompt_key": cfg.data.prompt_key, "answer_key": cfg.data.answer_key} if cfg else {})
        )
        rows = [
            dict(r, prompt=r[section.prompt_key], answer=r.get(section.answer_key))
            for r in load_examples(section, needs_answer=True)
        ][:limit]
        rollout = cfg.rollout if cfg else None
        settings = dict(
            max_new_tokens=max_new_tokens or (rollout.max_new_tokens if rollout else 48),
            temperature=temperature if temperature is not None else (rollout.temperature if rollout else 1.0),
            top_p=top_p if top_p is not None else (rollout.top_p if rollout else 1.0),
            top_k=top_k if top_k is not None else (rollout.top_k if rollout else 0),
            chat=chat if chat is not None else bool(cfg and cfg.data.chat_template),
            system_prompt=system_prompt if system_prompt is not None else (cfg.data.system_prompt if cfg else None),
        )
        verifier = verifier or (cfg.reward.verifier if cfg else "auto")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from bapo.analysis.evaluate import evaluate as run_eval

    hf_logging.disable_progress_bar()  # stdout carries only the JSON line
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    lm = AutoModelForCausalLM.from_pretrained(model_path).to(device)
    from bapo.train.data import special_token_warnings

    for message in special_token_warnings(tok, lm.generation_config):
        typer.echo(f"warning: {message}", err=True)
    with user_errors():
        try:
            score = eval_verifier(verifier, rows)
        except ValueError as err:
            raise ConfigError(f"--verifier {verifier}: {err}") from None
    scores = run_eval(lm, tok, rows, k=k, verifier=score, batch_size=batch_size, seed=seed, **settings)
    scores.update(model=model_path, seed=seed, **{f"sampling/{key}": value for key, value in settings.items()})
    typer.echo(json.dumps(scores))


def eval_verifier(name: str, rows: list[dict] | None = None):
    """The verifier `bapo eval --verifier NAME` uses: "demo" (the demo task's strict checker),
    "auto" (demo when every row is a prompt of that task, else "math"), or any bapo.train
    verifier name ("math", "exact", "pkg.module:attr")."""
    from bapo.experiments.task import is_task_prompt, verify

    if name == "auto":
        name = "demo" if rows and all(is_task_prompt(r["prompt"]) for r in rows) else "math"
    if name == "demo":
        return verify
    from bapo.train import resolve_verifier

    return resolve_verifier(name)


def register(app: typer.Typer) -> None:
    app.command("eval")(evaluate_command)
