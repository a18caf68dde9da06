"""`bapo demo`, `bapo plot`, `bapo compare` (heavy imports inside the bodies)."""

from __future__ import annotations

from pathlib import Path

import typer


def demo(
    quick: bool = typer.Option(
        False, "--quick", help="a glance: quick lab, grpo and bapo at E=0 and 4, 20 rollout steps"
    ),
    full: bool = typer.Option(False, "--full", help="adds topr, dcpo, E=7, async delay 4, partial rollout, 5 seeds"),
    out: Path | None = typer.Option(None, "--out", help="output dir (default runs/demo-<timestamp>)"),
    jobs: int | None = typer.Option(None, "--jobs", help="runs in parallel processes (default: one per CPU core)"),
    threads: int = typer.Option(1, "--threads", help="torch threads per process"),
    rollout_steps: int | None = typer.Option(None, "--rollout-steps", help="rollout steps per run (profile default)"),
    sft_steps: int | None = typer.Option(None, "--sft-steps", help="warm-start SFT steps"),
    lr: float | None = typer.Option(None, "--lr", help="RL learning rate (profile default)"),
    lab: bool = typer.Option(True, "--lab/--no-lab", help="run the mechanism lab (bapo lab) first"),
    as_json: bool = typer.Option(False, "--json", help="print the claims table as JSON (lab's, then the LLM runs')"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """The paper's claims, checked: the mechanism lab, then grpo / clip-higher / dual-clip / bapo
    on a tiny LLM at staleness E = 0, 2, 4 (E+1 optimizer updates per rollout batch)."""
    from bapo.experiments.demo import plan_for, run_demo

    if quick and full:
        raise typer.BadParameter("choose one of --quick and --full")
    plan = plan_for(
        "quick" if quick else "full" if full else "default",
        rollout_steps=rollout_steps,
        sft_steps=sft_steps,
        lr=lr,
        lab=None if lab else "off",
    )
    demo_dir = run_demo(plan, out, jobs=jobs, threads=threads, show_progress=progress and not as_json)
    if as_json:
        typer.echo((demo_dir / "claims.json").read_text().rstrip())
    else:
        import json

        typer.echo("")
        for line in json.loads((demo_dir / "demo.json").read_text())["headline"]:
            typer.echo(line.replace("**", ""))
        typer.echo(f"report: {demo_dir / 'report.md'}  plots: {demo_dir / 'plots'}  runs: {demo_dir}")


def plot(
    run_dirs: list[Path] = typer.Argument(..., help="run directories, or folders of runs"),
    out: Path | None = typer.Option(None, "--out", help="default: <first RUN_DIR>/plots"),
    target: float | None = typer.Option(None, "--target", help="draw bapo's target share"),
    smooth: int | None = typer.Option(None, "--smooth", help="moving-average window (updates)"),
):
    """Redraw the PNG plots from the runs' metrics.jsonl."""
    from bapo.analysis.plots import plot_runs
    from bapo.analysis.runs import find_runs

    paths = plot_runs(find_runs(run_dirs), out or run_dirs[0] / "plots", target, smooth)
    for p in paths:
        typer.echo(str(p))


def compare(
    run_dirs: list[Path] = typer.Argument(..., help="run directories, or folders of runs"),
    markdown: bool = typer.Option(False, "--markdown", help="print a markdown table"),
    claims: float | None = typer.Option(
        None, "--claims", metavar="TARGET", help="also judge the paper's claims (bapo target share TARGET)"
    ),
):
    """Print the per-run table (held-out avg@k / pass@k, entropy, shares, clipping; mean [95%
    interval] over seeds) of several runs, and optionally the claims table."""
    from bapo.analysis.claims import claims_markdown
    from bapo.analysis.report import format_cell, markdown_table, start_row, summary, table_columns
    from bapo.analysis.run_claims import run_claims
    from bapo.analysis.runs import find_runs

    runs = find_runs(run_dirs)
    rows = summary(runs)
    if claims is not None:
        typer.echo(claims_markdown(run_claims(runs, claims)) + "\n")
    if markdown:
        typer.echo(markdown_table(rows, start_row(runs)))
        return
    from rich.console import Console
    from rich.table import Table

    cols = table_columns(rows)
    table = Table("setting", "method", "seeds", *cols)
    for r in rows:
        table.add_row(r["setting"], r["method"], str(r["seeds"]), *(format_cell(*r[c]) for c in cols))
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
    app.command("plot")(plot)
    app.command("compare")(compare)
