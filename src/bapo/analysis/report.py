"""report.md and the comparison table, written only from the runs' metrics.jsonl.

Order of report.md: a few-line summary (`headline`), the setting, the claims table (computed
from the runs, bapo.analysis.run_claims; the lab's first when given), the plots (one panel per
setting, shaded 95% intervals over seeds), then the per-run table (mean [95% interval] over seeds
per setting and method), then what the updates did (bapo.analysis.mechanics: methods that
trained identically, BAPO's search outcomes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from bapo.analysis.claims import Claim, claims_markdown, detectable_effect, mean_interval
from bapo.analysis.mechanics import mechanics_section
from bapo.analysis.run_claims import grad_spike
from bapo.analysis.runs import Run, group_runs

# column -> one run's value; held-out columns are added in front by `summary`
RUN_COLUMNS: dict[str, Callable[[Run], float]] = {
    "entropy": lambda r: r.tail_mean("entropy"),
    "train reward": lambda r: r.tail_mean("reward/mean"),
    "positive share": lambda r: r.mean("positive_share"),
    "clip upper": lambda r: r.mean("clip_frac/upper"),
    "clip lower": lambda r: r.mean("clip_frac/lower"),
    "grad max/median": grad_spike,
    "ratio max": lambda r: max(r.values("ratio/max"), default=math.nan),
    "upper": lambda r: r.mean("upper"),
    "lower": lambda r: r.mean("lower"),
}
COLUMN_NOTES = (
    "held-out avg@k / pass@k: the final policy, k samples per held-out prompt at "
    "temperature 1; entropy, train reward: mean of the last 20% of updates; positive "
    "share, clip upper / lower (share of positive tokens above the upper bound / "
    "negative tokens below the lower bound), upper / lower (the bounds): mean over all "
    "updates; grad max/median: the largest gradient norm over the run's median (spikes); "
    "ratio max: the largest token ratio of the run. Cells: mean [95% interval] over seeds."
)


def format_cell(mean: float, low: float, high: float) -> str:
    if math.isnan(mean):
        return "-"
    if math.isnan(low):
        return f"{mean:.3f}"
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def eval_k(runs: list[Run]) -> int | None:
    ks = {int(r.final["k"]) for r in runs if r.final}
    return ks.pop() if len(ks) == 1 else None


def summary(runs: list[Run], columns: dict[str, Callable[[Run], float]] = RUN_COLUMNS) -> list[dict]:
    """One row per (setting, method): {"setting", "method", "seeds", column: (mean, low, high)}
    for every column of `columns` (the held-out scores first when the runs have them)."""
    k = eval_k(runs)
    out = []
    for setting, by_method in group_runs(runs).items():
        for method, group in by_method.items():
            row = {"setting": setting, "method": method, "seeds": len(group)}
            if k is not None:
                for name in (f"avg@{k}", f"pass@{k}"):
                    row[name] = mean_interval([r.final.get(name, math.nan) for r in group])
            for col, value in columns.items():
                row[col] = mean_interval([value(r) for r in group])
            out.append(row)
    return out


def start_row(runs: list[Run]) -> dict:
    """The start policy's held-out scores (heldout/start/... rows), mean over runs; {} if none."""
    scores: dict[str, list[float]] = {}
    for run in runs:
        for key, value in run.heldout("heldout/start/").items():
            if key != "k":
                scores.setdefault(key, []).append(value)
    return {key: sum(v) / len(v) for key, v in scores.items()}


def table_columns(rows: list[dict]) -> list[str]:
    return [c for c in rows[0] if c not in ("setting", "method", "seeds")] if rows else []


def markdown_table(rows: list[dict], start: dict | None = None) -> str:
    """The summary as a markdown table; `start` (the start policy's scores) as a first row."""
    cols = table_columns(rows)
    lines = ["| setting | method | seeds | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    if start:
        cells = [f"{start[c]:.3f}" if c in start else "-" for c in cols]
        lines.append("| start policy | sft | - | " + " | ".join(cells) + " |")
    for r in rows:
        cells = [format_cell(*r[c]) for c in cols]
        lines.append(f"| {r['setting']} | {r['method']} | {r['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The claims a user asks about first: does RL work here at all, does BAPO beat GRPO, and (the study)
# do the peers
HEADLINE_CLAIMS = ("0-rl-improves", "4-heldout", "4-entropy", "4-share", "5-heldout")


def _verdict_counts(claims: list[Claim]) -> str:
    counts = {v: sum(c.verdict == v for c in claims) for v in ("held", "not held", "mixed")}
    return f"{counts['held']} held, {counts['not held']} not held, {counts['mixed']} mixed of {len(claims)} claims"


def headline(claims: list[Claim], lab_claims: list[Claim] = (), model_label: str = "Tiny LLM") -> list[str]:
    """A few lines of what the runs show: the verdict counts, then one line per headline claim
    (HEADLINE_CLAIMS) with each setting's verdict, effect and 95% interval, and the smallest effect
    the plan detects with 80% power (from the seed spread; the largest over the settings). Printed
    at the end of `bapo demo` and leading report.md."""
    lines = [f"Mechanism lab (exact softmax): {_verdict_counts(list(lab_claims))}."] if lab_claims else []
    lines.append(f"{model_label}: {_verdict_counts(claims)}.")
    for family in HEADLINE_CLAIMS:
        members = [c for c in claims if c.id == family or c.id.startswith(family + "-")]
        if not members:
            continue
        cells = []
        for c in members:
            where = f"{c.id.removeprefix(family + '-')} " if c.id != family else ""
            numbers = f" ({c.detail})" if c.id == family and c.detail else ""
            interval = f"[{c.low:+.3f}, {c.high:+.3f}]" if math.isfinite(c.low) else f"(no interval: {c.seeds} seed)"
            cells.append(f"{where}**{c.verdict}** {c.effect:+.3f} {interval}{numbers}")
        detectable = [detectable_effect(c.low, c.high, c.seeds) for c in members]
        finite = [value for value in detectable if math.isfinite(value)]
        power = f" (detectable with 80% power: {max(finite):.3f})" if finite else ""
        lines.append(f"{members[0].text}: " + "; ".join(cells) + power)
    return lines


def write_report(
    path: Path,
    runs: list[Run],
    claims: list[Claim],
    plots: list[Path],
    target_share: float | None,
    header: list[str],
    lab_claims: list[Claim] = (),
    title: str = "bapo demo report",
    model_label: str = "Tiny LLM",
    columns: dict[str, Callable[[Run], float]] = RUN_COLUMNS,
    notes: str = COLUMN_NOTES,
) -> Path:
    """report.md: `header` lines, the claims tables, the plots (relative links), the run table;
    `title` heads it, `model_label` names the runs' model (bapo study: SmolLM2-135M-Instruct)."""
    path = Path(path)
    verdicts = {v: sum(c.verdict == v for c in claims) for v in ("held", "not held", "mixed")}
    parts = [
        f"# {title}",
        "",
        "## Summary",
        "",
        *[f"- {line}" for line in headline(claims, list(lab_claims), model_label)],
        "",
        "Effect > 0 is the direction the paper claims; verdicts from 95% intervals over seeds (details below).",
        "",
        "## Setting",
        "",
        *header,
        "",
        "## Claims of the paper, judged from these runs",
        "",
        "Effect > 0 is the direction the paper claims; the verdict is read from the 95% interval "
        "over seeds: held (all above 0), not held (all below 0), mixed (contains 0).",
        "",
    ]
    if lab_claims:
        parts += ["### Mechanism lab (tabular softmax, exact)", "", claims_markdown(lab_claims), ""]
    parts += [
        f"### {model_label}",
        "",
        f"{verdicts['held']} held, {verdicts['not held']} not held, {verdicts['mixed']} mixed.",
        "",
        claims_markdown(claims) if claims else "(no claim has its runs here)",
        "",
        "## Plots",
        "",
        "One panel per setting, one line per method: mean over seeds, shaded 95% interval."
        + (f" Dotted line: bapo's target share {target_share}." if target_share is not None else ""),
        "",
    ]
    parts += [f"![{p.stem}]({p.relative_to(path.parent).as_posix()})" for p in plots]
    parts += ["", "## Per-run table", "", markdown_table(summary(runs, columns), start_row(runs)), "", notes]
    mechanics = mechanics_section(runs)
    if mechanics:
        parts += ["", "## What the updates did", "", *mechanics]
    path.write_text("\n".join(parts) + "\n")
    return path


def replace_block(text: str, start: str, end: str, block: str, where: str = "the file") -> str:
    """`text` with the part from marker `start` to marker `end` (both included) replaced by
    `block` (which carries the markers itself); ValueError naming `where` when a marker is missing.
    Keeps docs tables (docs/RESULTS.md) written by code, from the runs."""
    if start not in text or end not in text:
        raise ValueError(f"{where} has no {start} ... {end} block; add the two markers where it goes")
    before, rest = text.split(start, 1)
    return before + block + rest.split(end, 1)[1]
