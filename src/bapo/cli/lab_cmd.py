"""`bapo lab`: the mechanism lab (tabular softmax policy, exact entropy) and its claims table."""

from __future__ import annotations

from pathlib import Path

import typer

from bapo.cli.errors import refuse

STALE_K_RENAMED = (
    "--stale-k was renamed --async-delays: write bapo lab --async-delays instead (k is the async delay, "
    "bapo train's offpolicy.async_delay; the paper's staleness E is another axis)"
)


def lab(
    quick: bool = typer.Option(False, "--quick", help="6 seeds, 12 rollout batches, grpo and bapo at E 0 and 4"),
    peers: bool = typer.Option(
        False,
        "--peers",
        help="every lab-capable method (grpo, clip-higher, dual-clip, bapo, topr, dcpo and the peers of "
        "bapo.core.peers) at E 0/2/4/8 and async delay 2/4/8/16/64, each at its defaults; leaderboards vs grpo",
    ),
    async_delays: bool = typer.Option(
        False,
        "--async-delays",
        help="the async delay k run long: grpo, unclipped, m2po, m2po-official, bapo, decoupled-ppo at async "
        "delay 4/16/64/256 for 384 rollout steps, 10 seeds; leaderboards vs grpo (early reward, reward at the end, "
        "drawdown, entropy at the end and at matched reward)",
    ),
    stale_k: bool = typer.Option(False, "--stale-k", hidden=True),  # renamed --async-delays: refused below
    regimes: bool = typer.Option(
        False,
        "--regimes",
        help="the regime map (docs/LAB_REGIMES.md): filler positions x prior peakedness, Adam, shared "
        "parameters, full-batch epochs; grpo / bapo / BAPO's stages apart at E 4, claims per regime; "
        "with --quick 7 small regimes, 4 seeds, 8 rollout batches (no plots; output runs/lab-regimes-<timestamp>)",
    ),
    choose_lr: bool = typer.Option(
        False,
        "--choose-lr",
        help="with --regimes: rerun the learning-rate choice (on-policy GRPO only), print it as JSON (writes nothing)",
    ),
    seeds: int | None = typer.Option(
        None, "--seeds", help="seeds per cell (default 20; --quick 6, --async-delays 10, --regimes --quick 4)"
    ),
    out: Path | None = typer.Option(None, "--out", help="output dir (default runs/lab-<timestamp>)"),
    jobs: int | None = typer.Option(None, "--jobs", help="processes (default: one per CPU core)"),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="print the claims table as JSON (--peers / --async-delays: claims.json, leaderboards included; "
        "--regimes: regimes.json)",
    ),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="draw the PNG plots of the report"),
):
    """The paper's claims tested on an exact tabular softmax policy, with 95% intervals over seeds."""
    from bapo.analysis.claims import claims_json
    from bapo.lab.lab import plan_for, run_lab

    if stale_k:  # refused, never read as the new flag: one line naming it, as a renamed config key gets
        refuse(STALE_K_RENAMED)
    modes = [flag for flag, on in (("--peers", peers), ("--async-delays", async_delays), ("--regimes", regimes)) if on]
    if len(modes) > 1:
        raise typer.BadParameter(f"{' and '.join(modes)}: choose one")
    if choose_lr and not regimes:
        raise typer.BadParameter("--choose-lr goes with --regimes: bapo lab --regimes --choose-lr")
    if regimes:
        _regimes(quick, choose_lr, seeds, out, jobs, as_json)
        return
    try:
        plan = plan_for(quick, seeds, peers=peers, async_delays=async_delays)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    claims, out_dir = run_lab(out, plan=plan, jobs=jobs, plots=plots)
    boarded = peers or async_delays
    if as_json:  # with leaderboards, their vs-grpo claims too (claims.json)
        typer.echo((out_dir / "claims.json").read_text().rstrip("\n") if boarded else claims_json(claims))
        return
    _print_table(claims)
    boards = out_dir / "leaderboards.md"
    if boarded and boards.exists():
        typer.echo(
            f"\nbapo lab {'--peers' if peers else '--async-delays'}: leaderboards "
            "(mean [95% interval] over seeds; vs grpo paired by seed, > 0 = better)\n"
        )
        typer.echo(boards.read_text())
    typer.echo(f"report: {out_dir / 'report.md'}")


def _regimes(
    quick: bool, choose_lr: bool, seeds: int | None, out: Path | None, jobs: int | None, as_json: bool
) -> None:
    """`bapo lab --regimes [--quick]`, or `--regimes --choose-lr` (prints JSON, writes nothing)."""
    import json

    from bapo.lab import regimes as regime_lab

    if choose_lr and quick:
        raise typer.BadParameter("--choose-lr reruns the full learning-rate grid; drop --quick (--seeds N for fewer)")
    try:
        base = regime_lab.plan_regimes(quick, seeds)[1]
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if choose_lr:
        chosen, grid = regime_lab.choose_learning_rates(base, jobs)
        rows = {f"{o} {p}".strip(): [list(row) for row in values] for (o, p), values in grid.items()}
        result = {"chosen": {f"{o} {p}": lr for (o, p), lr in chosen.items()}, "grid (lr, mean, low, high)": rows}
        typer.echo(json.dumps(result, indent=2))
        return
    _, out_dir = regime_lab.run_regimes(out, quick=quick, seeds=seeds, jobs=jobs)
    if as_json:
        typer.echo((out_dir / "regimes.json").read_text().rstrip("\n"))
        return
    text = (out_dir / "regimes.md").read_text()
    typer.echo(text.split("\n## Every regime's claims")[0])
    typer.echo(f"report: {out_dir / 'regimes.md'}")


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
