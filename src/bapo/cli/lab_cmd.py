"""`bapo lab`: the mechanism lab (tabular softmax policy, exact entropy) and its claims table."""

from __future__ import annotations

from pathlib import Path

import typer


def lab(
    quick: bool = typer.Option(False, "--quick", help="6 seeds, 12 rollout batches, grpo and bapo at E 0 and 4"),
    peers: bool = typer.Option(
        False,
        "--peers",
        help="every lab-capable method (grpo, clip-higher, dual-clip, bapo, topr, dcpo and the peers of "
        "bapo.core.peers) at E 0/2/4/8 and async delay 2/4/8/16/64, each at its defaults; leaderboards vs grpo",
    ),
    stale_k: bool = typer.Option(
        False,
        "--stale-k",
        help="M2PO's stale-k axis run long: grpo, unclipped, m2po, m2po-official, bapo, decoupled-ppo at async "
        "delay 4/16/64/256 for 384 rollout steps, 10 seeds; leaderboards vs grpo (early reward, end, drawdown)",
    ),
    seeds: int | None = typer.Option(None, "--seeds", help="seeds per cell (default 20; --stale-k 10)"),
    out: Path | None = typer.Option(None, "--out", help="output dir (default runs/lab-<timestamp>)"),
    jobs: int | None = typer.Option(None, "--jobs", help="processes (default: one per CPU core)"),
    as_json: bool = typer.Option(False, "--json", help="print the claims table as JSON"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="draw the PNG plots of the report"),
):
    """The paper's claims tested on an exact tabular softmax policy, with 95% intervals over seeds."""
    from bapo.analysis.claims import claims_json
    from bapo.lab.lab import plan_for, run_lab

    try:
        plan = plan_for(quick, seeds, peers=peers, stale_k=stale_k)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    claims, out_dir = run_lab(out, plan=plan, jobs=jobs, plots=plots)
    boarded = peers or stale_k
    if as_json:  # with leaderboards, their vs-grpo claims too (claims.json)
        typer.echo((out_dir / "claims.json").read_text().rstrip("\n") if boarded else claims_json(claims))
        return
    _print_table(claims)
    boards = out_dir / "leaderboards.md"
    if boarded and boards.exists():
        typer.echo(
            f"\nbapo lab {'--peers' if peers else '--stale-k'}: leaderboards "
            "(mean [95% interval] over seeds; vs grpo paired by seed, > 0 = better)\n"
        )
        typer.echo(boards.read_text())
    typer.echo(f"report: {out_dir / 'report.md'}")


def _print_table(claims) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bapo lab: claims (effect > 0 = the paper's direction, 95% interval over seeds)")
    for column in ("claim", "setting", "verdict", "effect [95% interval]", "seeds", "numbers"):
        table.add_column(column, overflow="fold")
    colors = {"held": "green", "not held": "red", "mixed": "yellow"}
    for c in claims:
        table.add_row(
            c.id,
            c.setting,
            f"[{colors[c.verdict]}]{c.verdict}[/]",
            f"{c.effect:+.3g} [{c.low:+.3g}, {c.high:+.3g}]",
            str(c.seeds),
            c.detail,
        )
    Console(width=200).print(table)


def register(app: typer.Typer) -> None:
    app.command("lab")(lab)
