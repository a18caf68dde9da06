"""`bapo demo`, `bapo plot`, `bapo compare` (heavy imports inside the bodies)."""

from __future__ import annotations

from pathlib import Path

import typer


def demo(
    quick: bool = typer.Option(False, "--quick", help="a ~2 minute glance: grpo and bapo, 20 updates"),
    full: bool = typer.Option(False, "--full", help="adds topr, dcpo, partial rollout, 3 seeds"),
    out: Path | None = typer.Option(None, "--out", help="output dir (default runs/demo-<timestamp>)"),
    jobs: int | None = typer.Option(None, "--jobs", help="runs in parallel processes "
                                       "(default: one per CPU core)"),
    threads: int = typer.Option(1, "--threads", help="torch threads per process"),
    steps: int | None = typer.Option(None, "--steps", help="updates per run (profile default)"),
    sft_steps: int | None = typer.Option(None, "--sft-steps", help="warm-start SFT steps"),
    lr: float | None = typer.Option(None, "--lr", help="RL learning rate (profile default)"),
    staleness: int | None = typer.Option(None, "--staleness",
                                            help="the high staleness compared with 0"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """The paper's staleness experiment in miniature on the built-in task and tiny model."""
    from bapo.demo.demo import plan_for, run_demo

    if quick and full:
        raise typer.BadParameter("choose one of --quick and --full")
    plan = plan_for("quick" if quick else "full" if full else "default", steps=steps,
                    sft_steps=sft_steps, lr=lr,
                    staleness=None if staleness is None else (0, staleness))
    demo_dir = run_demo(plan, out, jobs=jobs, threads=threads, show_progress=progress)
    typer.echo(f"report: {demo_dir / 'report.md'}")


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
):
    """Print the final table (held-out avg@k / pass@k, tail means) of several runs."""
    from bapo.analysis.report import format_cell, markdown_table, summary, table_columns
    from bapo.analysis.runs import find_runs

    rows = summary(find_runs(run_dirs))
    if markdown:
        typer.echo(markdown_table(rows))
        return
    from rich.console import Console
    from rich.table import Table

    cols = table_columns(rows)
    table = Table("setting", "method", *cols)
    for r in rows:
        table.add_row(r["setting"], r["method"], *(format_cell(*r[c], r["seeds"]) for c in cols))
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
    app.command("plot")(plot)
    app.command("compare")(compare)
