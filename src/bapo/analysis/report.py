"""report.md and the comparison table, written only from the runs' own files.

Every number and every sentence comes from metrics.jsonl / final_eval.json of the runs passed
in; the sentences name which method came out higher or lower, whichever way that is.
"""

from __future__ import annotations

import math
from pathlib import Path

from bapo.analysis.runs import Run, group_runs, mean_std

# (column, how to get one run's value): final held-out scores, then training-time tail means
TAIL_COLUMNS = {"entropy": "entropy", "train reward": "reward/mean",
                "positive share": "positive_share", "clipped": "clip_frac",
                "upper": "upper", "lower": "lower"}


def format_cell(mean: float, std: float, seeds: int) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.3f} +- {std:.3f}" if seeds > 1 else f"{mean:.3f}"


def eval_k(runs: list[Run]) -> int | None:
    ks = {int(r.final["k"]) for r in runs if "k" in r.final}
    return ks.pop() if len(ks) == 1 else None


def summary(runs: list[Run]) -> list[dict]:
    """One row per (setting, method): {"setting", "method", "seeds", column: (mean, std)}.

    Held-out columns come from final_eval.json (avg@k, pass@k); the others are means over
    the last 20% of updates of metrics.jsonl, then mean +- std over seeds.
    """
    k = eval_k(runs)
    out = []
    for setting, by_method in group_runs(runs).items():
        for method, group in by_method.items():
            row = {"setting": setting, "method": method, "seeds": len(group)}
            if k is not None:
                for name in (f"avg@{k}", f"pass@{k}"):
                    row[name] = mean_std([r.final.get(name, math.nan) for r in group])
            for col, key in TAIL_COLUMNS.items():
                row[col] = mean_std([r.tail_mean(key) for r in group])
            # not a table column: how far the positive share wandered over the whole run
            spans = [max(v) - min(v) for v in (r.series("positive_share")[1] for r in group) if v]
            row["_share_span"] = sum(spans) / len(spans) if spans else math.nan
            out.append(row)
    return out


def table_columns(rows: list[dict]) -> list[str]:
    return [c for c in rows[0] if c not in ("setting", "method", "seeds") and not c.startswith("_")] \
        if rows else []


def markdown_table(rows: list[dict], start: dict | None = None) -> str:
    """The summary as a markdown table; `start` (the start policy's scores) as a first row."""
    cols = table_columns(rows)
    lines = ["| setting | method | " + " | ".join(cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    if start:
        cells = [f"{start[c]:.3f}" if c in start else "-" for c in cols]
        lines.append("| start policy | sft | " + " | ".join(cells) + " |")
    for r in rows:
        cells = [format_cell(*r[c], r["seeds"]) for c in cols]
        lines.append(f"| {r['setting']} | {r['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _extremes(rows: list[dict], col: str) -> str:
    scored = [(r[col][0], r["method"]) for r in rows if col in r and not math.isnan(r[col][0])]
    if len(scored) < 2:
        return ""
    hi, lo = max(scored), min(scored)
    if f"{hi[0]:.3f}" == f"{lo[0]:.3f}":
        return f"{col} equal for all methods ({hi[0]:.3f})"
    return f"highest {col} {hi[1]} ({hi[0]:.3f}), lowest {lo[1]} ({lo[0]:.3f})"


def findings(rows: list[dict], start: dict | None, target_share: float | None) -> list[str]:
    """Plain sentences read off the summary rows; nothing here is decided in advance."""
    lines = []
    k_col = next((c for c in table_columns(rows) if c.startswith("avg@")), None)
    by_setting: dict[str, list[dict]] = {}
    for r in rows:
        by_setting.setdefault(r["setting"], []).append(r)
    for setting, group in by_setting.items():
        parts = [p for p in (_extremes(group, "entropy"), k_col and _extremes(group, k_col),
                             _extremes(group, "train reward")) if p]
        if parts:
            lines.append(f"At {setting}: " + "; ".join(parts) + ".")
        clipped = [r["clipped"][0] for r in group if not math.isnan(r["clipped"][0])]
        if clipped and max(clipped) == 0:
            lines.append(f"At {setting} no token was ever clipped (every ratio is 1 on-policy), "
                         "so the clipping rules cannot make the methods differ there.")
    staleness = sorted((int(s.split()[-1]), s) for s in by_setting if s.startswith("staleness "))
    if len(staleness) >= 2:
        (lo_k, lo_s), (hi_k, hi_s) = staleness[0], staleness[-1]
        changes = []
        for r_hi in by_setting[hi_s]:
            r_lo = next((r for r in by_setting[lo_s] if r["method"] == r_hi["method"]), None)
            if r_lo is not None:
                changes.append((r_hi["entropy"][0] - r_lo["entropy"][0], r_hi["method"]))
        if changes:
            text = ", ".join(f"{m} {d:+.3f}" for d, m in changes)
            least = max(changes)
            lines.append(f"Going from staleness {lo_k} to {hi_k}, final entropy changed by: {text}"
                         f" (smallest loss or largest gain: {least[1]}).")
        hi_rows = {r["method"]: r for r in by_setting[hi_s]}
        if "grpo" in hi_rows and "bapo" in hi_rows:
            g, b = hi_rows["grpo"]["entropy"][0], hi_rows["bapo"]["entropy"][0]
            verdict = "higher" if b > g else "lower" if b < g else "equal"
            lines.append(f"At staleness {hi_k}, bapo's final entropy ({b:.3f}) is {verdict} than "
                         f"grpo's ({g:.3f}); the paper predicts higher.")
    if start and "entropy" in start:
        lines.append(f"The start policy's entropy at the first update was {start['entropy']:.3f}.")
    if start and k_col and k_col in start:
        better = [f"{r['method']} at {r['setting']}" for r in rows if r[k_col][0] > start[k_col]]
        worse = [f"{r['method']} at {r['setting']}" for r in rows if r[k_col][0] <= start[k_col]]
        lines.append(f"Against the start policy's held-out {k_col} of {start[k_col]:.3f}: "
                     f"above it: {', '.join(better) or 'none'}; not above it: "
                     f"{', '.join(worse) or 'none'}.")
    bapo_rows = [r for r in rows if r["method"] == "bapo"]
    if bapo_rows and target_share is not None:
        shares = ", ".join(f"{r['setting']} {r['positive share'][0]:.3f}" for r in bapo_rows)
        lines.append(f"bapo's positive share over the last 20% of updates: {shares} "
                     f"(target {target_share:.2f}); its bounds ended near "
                     + ", ".join(f"[{r['lower'][0]:.2f}, {r['upper'][0]:.2f}]" for r in bapo_rows)
                     + ".")
    for setting, group in by_setting.items():
        spans = [(r["_share_span"], r["method"]) for r in group if not math.isnan(r["_share_span"])]
        if len(spans) > 1 and any(r["clipped"][0] > 0 for r in group):
            lines.append(f"At {setting}, the positive share moved over a range (max - min over "
                         "updates) of " + ", ".join(f"{m} {v:.4f}" for v, m in spans)
                         + f"; narrowest: {min(spans)[1]}.")
    if rows and max(r["seeds"] for r in rows) == 1:
        lines.append("One seed per cell: differences of a few points may be noise; "
                     "`bapo demo --full` runs 3 seeds and reports mean +- std.")
    return lines


def write_report(path: Path, runs: list[Run], start: dict | None, plots: list[Path],
                 target_share: float | None, header: list[str]) -> Path:
    """report.md: `header` lines, the table, what it shows, the plots (relative links)."""
    rows = summary(runs)
    path = Path(path)
    parts = ["# bapo demo report", "", *header, "", "## Final table", "",
             markdown_table(rows, start), "",
             f"Held-out columns: final policy, k samples per held-out prompt at temperature 1. "
             "Other columns: mean over the last 20% of updates. +- is the std over seeds.", "",
             "## What the numbers show", "", *[f"- {line}" for line in findings(rows, start, target_share)],
             "", "## Plots", ""]
    parts += [f"![{p.stem}]({p.relative_to(path.parent).as_posix()})" for p in plots]
    path.write_text("\n".join(parts) + "\n")
    return path
