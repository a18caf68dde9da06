"""`bapo study` (heavy imports inside the body)."""

from __future__ import annotations

from pathlib import Path

import typer


def study(
    out: Path | None = typer.Option(None, "--out", help="study folder (default runs/study-<timestamp>)"),
    resume: Path | None = typer.Option(
        None, "--resume", help="continue the study in this folder with its saved plan (finished runs are skipped)"
    ),
    quick: bool = typer.Option(False, "--quick", help="a check: one seed, grpo and bapo at E=4, 5 rollout steps"),
    gpu: bool = typer.Option(
        False,
        "--gpu",
        help="the plan in the regime (docs/study/regime-plan) on a CUDA device with HF rollout, icepop left out "
        "(it needs vLLM): scripts/gpu_study.sh",
    ),
    regime: bool = typer.Option(
        False,
        "--regime",
        help="the regime gate: grpo only, 64-token budget, 8x8 batch, 40 rollout steps, E 0,3, async delay 8",
    ),
    seeds: str | None = typer.Option(None, "--seeds", help="comma-separated seeds (default 0,1,2; --gpu: 0-4)"),
    lr: float | None = typer.Option(None, "--lr", help="RL learning rate (the plan's default: docs/STUDY.md)"),
    lora_rank: int | None = typer.Option(
        None,
        "--lora-rank",
        min=1,
        help="train LoRA adapters of this rank (alpha 32, every linear layer) instead of every weight; "
        "LoRA Without Regret takes ~10x the full lr (--lr)",
    ),
    task: str | None = typer.Option(
        None,
        "--task",
        help="the task's space, e.g. '*:2-19:2-29:64' (op or ops, a's range, b's range, reply budget in tokens; "
        "default '+:2-19:2-29:10', --regime '+:2-19:2-29:64')",
    ),
    rollout_steps: int | None = typer.Option(None, "--rollout-steps", help="rollout steps per run"),
    temperature: float | None = typer.Option(
        None,
        "--temperature",
        help="sampling temperature of rollouts and of the held-out avg@k (default 0.7; verl's and TRL's 1.0)",
    ),
    methods: str | None = typer.Option(
        None,
        "--methods",
        help="comma-separated methods (the full plan's: grpo, clip-higher, bapo, bapo-paper, m2po, decoupled-ppo; "
        "--regime's: grpo; any of them and grpo-seq-mean, dppo-tv, icepop, opsm)",
    ),
    staleness_e: str | None = typer.Option(
        None, "--staleness", help="comma-separated staleness E values, E+1 updates per rollout batch (default 0,4)"
    ),
    delays: str | None = typer.Option(None, "--delays", help="comma-separated async delays k (default 4,16; '' none)"),
    partial: str | None = typer.Option(
        None,
        "--partial",
        help="comma-separated methods also run with partial rollout at E=0, grpo among them (default none)",
    ),
    segment_tokens: int | None = typer.Option(
        None,
        "--segment-tokens",
        help="with --partial: new tokens per reply per rollout step (default a quarter of the reply budget)",
    ),
    autocast: str | None = typer.Option(
        None, "--autocast", help="model.autocast of every run: none | bfloat16 | auto (default: bfloat16 where native)"
    ),
    threads: int = typer.Option(2, "--threads", help="torch threads of each run"),
    max_runs: int | None = typer.Option(
        None, "--max-runs", min=1, help="stop after this many runs finish in this sitting (--resume continues)"
    ),
    gate: list[Path] = typer.Option(
        None, "--gate", help="print the regime gate of these study folders' grpo runs (repeat the option)"
    ),
    reuse: list[Path] = typer.Option(
        None,
        "--reuse",
        help="copy the finished runs of this study folder that the plan would train alike (same cell, seed, "
        "config, held-out settings and split), e.g. the regime gate's grpo runs (repeat the option)",
    ),
    report_only: bool = typer.Option(False, "--report", help="with --resume: only rewrite the report"),
    results: Path | None = typer.Option(
        None, "--results", help="with --report: also write the tables into this file's STUDY_TABLES block"
    ),
):
    """Does BAPO help a real pretrained model on stale data? SmolLM2-135M-Instruct with vLLM rollout
    on in-house arithmetic: grpo, clip-higher, bapo (default and paper presets), m2po and decoupled
    PPO at staleness E = 0, 4 and async delay k = 4, 16, 3 seeds; claims with 95% intervals.
    --regime: the regime gate's plan (grpo alone where failing replies are longer; docs/STUDY.md);
    --gate DIR reads its verdict. --gpu: the plan in that regime (every method, 5 seeds) on CUDA with
    HF rollout."""
    import time

    from bapo.experiments.study import finished_runs, load_plan, plan_for, run_study, write_study_report

    def ints(text: str | None) -> tuple[int, ...] | None:
        if text is None:
            return None
        try:
            return tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise typer.BadParameter(f"{text!r}: comma-separated integers expected") from None

    plan_options = (
        *(out, seeds, lr, lora_rank, task, rollout_steps, temperature, methods, staleness_e, delays),
        *(partial, segment_tokens, autocast),
    )
    if gate:
        from bapo.experiments.study import gate_lines

        if any(v is not None for v in (*plan_options, resume, results, max_runs)) or quick or gpu or regime or reuse:
            raise typer.BadParameter("--gate only reads study folders: give it no other option")
        missing = [str(folder) for folder in gate if not (folder / "study.json").exists()]
        if missing:
            raise typer.BadParameter(f"--gate: {', '.join(missing)} holds no study (no study.json)")
        try:
            typer.echo("\n".join(gate_lines(gate)))
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        return
    if report_only and reuse:
        raise typer.BadParameter("--report only rewrites the report: drop --reuse")
    for folder in reuse or ():
        check_study_folder(folder, "--reuse")
    if segment_tokens is not None and not partial:
        raise typer.BadParameter("--segment-tokens sets --partial's segment: give --partial METHODS as well")
    if resume is not None:
        if any(v is not None for v in plan_options) or quick or gpu or regime:
            raise typer.BadParameter("--resume continues the saved plan: give no other plan option")
        plan, study_dir = load_plan(resume), resume
        if not report_only:
            check_device(plan.device)
            check_vllm(plan.backend, resume)
            if len(finished_runs(plan, resume)) < len(plan.runs()):  # runs left to train need the model
                reconvert_missing_model(plan.model)
    else:
        if report_only:
            raise typer.BadParameter("--report needs --resume DIR")
        if quick + gpu + regime > 1:
            raise typer.BadParameter("--quick, --gpu and --regime are three plans: give one")
        from bapo.experiments.study import METHODS

        def method_names(option: str, text: str | None) -> tuple[str, ...] | None:
            chosen = tuple(m.strip() for m in text.split(",") if m.strip()) if text is not None else None
            unknown = [m for m in chosen or () if m not in METHODS]
            if unknown:
                raise typer.BadParameter(f"{option}: {', '.join(unknown)} not among {', '.join(METHODS)}")
            return chosen

        chosen = method_names("--methods", methods or None)
        profile = "quick" if quick else "gpu" if gpu else "regime" if regime else "full"
        try:
            from bapo.experiments.arith import task_from_spec
            from bapo.experiments.study import PROFILES

            plan = plan_for(
                profile,
                task=task_from_spec(task, PROFILES[profile].task) if task is not None else None,
                seeds=ints(seeds),
                lr=lr,
                lora_rank=lora_rank,
                rollout_steps=rollout_steps,
                temperature=temperature,
                methods=chosen,
                staleness_e=ints(staleness_e),
                async_delays=ints(delays),
                partial_rollout_methods=method_names("--partial", partial),
                segment_tokens=segment_tokens,
                autocast=autocast,
            )
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        check_device(plan.device)  # before any work: converting the model, writing the split
        check_vllm(plan.backend, None)
        check_peft(plan.lora_rank)
        if plan.model == "smollm2":
            from dataclasses import replace

            # the converted folder (cached), saved in study.json
            plan = replace(plan, model=str(converted_smollm2(None, "bapo study needs SmolLM2-135M-Instruct converted")))
        study_dir = out or Path("runs") / time.strftime("study-%Y%m%d-%H%M%S")
        if (study_dir / "study.json").exists():
            raise typer.BadParameter(f"--out {study_dir} already holds a study: continue it with --resume {study_dir}")
    if report_only:
        report = write_study_report(plan, study_dir, record_headline=False)  # a running study owns study.json
        typer.echo(f"report: {report}" if report else "no finished run yet")
        if results is not None and report:
            from bapo.analysis.report import replace_block
            from bapo.experiments.study import TABLES_END, TABLES_START, study_tables

            block = study_tables(plan, study_dir, f"bapo study --resume {study_dir}")
            try:
                results.write_text(replace_block(results.read_text(), TABLES_START, TABLES_END, block, str(results)))
            except ValueError as err:
                raise typer.BadParameter(str(err)) from None
            typer.echo(f"wrote the study tables into {results}")
        return
    started = time.time()
    from bapo.experiments.study import RunFailed

    try:
        run_study(
            plan,
            study_dir,
            threads=threads,
            log=lambda line: typer.echo(line),
            max_runs=max_runs,
            reuse=tuple(reuse or ()),
        )
    except RunFailed as err:  # the child printed its own error; this is the one line after it
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    import json

    for line in json.loads((study_dir / "study.json").read_text()).get("headline", []):
        typer.echo(line.replace("**", ""))
    typer.echo(f"report: {study_dir / 'report.md'}  ({time.time() - started:.0f} s)")


def check_study_folder(folder: Path, option: str) -> None:
    """One line, before any work, when `folder` is not a readable study (its plan and task split)."""
    from bapo.experiments.study import load_plan

    try:
        load_plan(folder)
    except (FileNotFoundError, KeyError, ValueError, TypeError) as err:
        reason = "no study.json" if isinstance(err, FileNotFoundError) else f"its study.json holds no valid plan: {err}"
        raise typer.BadParameter(f"{option} {folder}: not a bapo study folder ({reason})") from None
    missing = [split for split in ("train.jsonl", "heldout.jsonl") if not (folder / "data" / split).exists()]
    if missing:
        raise typer.BadParameter(
            f"{option} {folder}: its task split data/{missing[0]} is missing; copy the whole folder"
        )


def check_peft(lora_rank: int | None) -> None:
    """--lora-rank without peft: the one line model.lora's check prints, before any work (each run
    would otherwise fail in its own process after the model is converted and study.json written)."""
    import importlib.util

    if lora_rank is not None and importlib.util.find_spec("peft") is None:
        raise typer.BadParameter(
            f"--lora-rank {lora_rank} needs peft, which is not installed: pip install 'bapo[train]' (or pip install "
            "peft), or drop --lora-rank"
        )


def check_device(device: str) -> None:
    """One line, before any work, when the plan's device is not on this machine (model.device's check)."""
    from bapo.train.config import device_problem

    problem = device_problem(device)
    if problem:
        raise typer.BadParameter(f"the plan's device is {device}: {problem[0]}; run it where there is one")


def reconvert_missing_model(model: str) -> None:
    """A study resumed on a new machine (a clone of committed records): the converted SmolLM2
    folder its study.json names is rebuilt at that same path, which the runs' configs and the
    start policy's cache key hold. Any other missing folder is left to the run's own check."""
    from bapo.experiments.smollm2 import FOLDER

    path = Path(model)
    if path.name == FOLDER and not (path / "config.json").exists():
        typer.echo(f"{path} is missing on this machine: converting SmolLM2-135M-Instruct into it", err=True)
        converted_smollm2(
            path,
            f"study.json's model {path} is missing and could not be rebuilt there; the runs' model.path must "
            f"stay {path}: make {path.parent} writable, or resume where it exists",
        )


def converted_smollm2(path: Path | None, why: str) -> Path:
    """bapo smollm2's converted folder (at `path`, else its default place), converted when missing;
    a failed conversion (no gguf package or GGUF file: ValueError; a folder this user cannot write:
    OSError) is one line, `why` and the error."""
    from bapo.experiments.smollm2 import convert

    try:
        return convert(path)
    except (ValueError, OSError) as err:
        raise typer.BadParameter(f"{why} ({err})") from None


def check_vllm(backend: str, resume: Path | None) -> None:
    """One line and exit 2, before any work, when the plan samples with vLLM and this Python lacks it."""
    from bapo.cli.errors import user_errors
    from bapo.train.config import ConfigError, vllm_missing

    command = f"bapo study --resume {resume}" if resume else "bapo study ..."
    missing = vllm_missing("bapo study samples with vLLM", command, "run bapo study --gpu there (HF rollout)")
    if backend == "vllm" and missing:
        with user_errors():
            raise ConfigError(missing)


def register(app: typer.Typer) -> None:
    app.command("study")(study)
