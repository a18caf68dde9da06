"""Regenerate the demo tables of docs/RESULTS.md from a finished `bapo demo` run, so that the
figures the docs quote always come from a run of the current code:

    python scripts/demo_tables.py runs/demo-<time>                         # print the block
    python scripts/demo_tables.py runs/demo-<time> --write docs/RESULTS.md  # replace it in place

The block (between the two DEMO_TABLES markers) holds the headline, the LLM claims table and the
per-method table, all computed from the runs' metrics.jsonl by bapo.analysis (the same code as
report.md), plus the plan, the commit and the timings from demo.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from bapo.analysis.claims import claims_markdown
from bapo.analysis.report import COLUMN_NOTES, headline, markdown_table, replace_block, start_row, summary
from bapo.analysis.run_claims import run_claims
from bapo.analysis.runs import find_runs

START, END = "<!-- DEMO_TABLES:START (scripts/demo_tables.py) -->", "<!-- DEMO_TABLES:END -->"


def demo_tables(demo_dir: Path, command: str) -> str:
    info = json.loads((demo_dir / "demo.json").read_text())
    plan = info["plan"]
    runs = find_runs(sorted(path for path in demo_dir.iterdir() if (path / "demo_run.json").exists()))
    claims = run_claims(runs, plan["bapo_target"])
    timings = info["timings_s"]
    run_seconds = sum(seconds for name, seconds in info["cpu_s"].items() if name != "warm start")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        START,
        f"Run: `{command}` (code {commit or 'unknown'}); {len(runs)} runs, methods "
        f"{', '.join(plan['methods'])}, staleness E = {', '.join(map(str, plan['staleness_e']))}, seeds "
        f"{', '.join(map(str, plan['seeds']))}, {plan['rollout_steps']} rollout steps, held-out "
        f"avg@{plan['final_k']} / pass@{plan['final_k']}; {timings['total']:.0f} s wall in all "
        f"(lab {timings['lab']:.0f} s, warm start {timings['warm start']:.0f} s, runs {run_seconds:.0f} CPU s "
        f"over {info['jobs']} processes x {info['threads']} thread).",
        "",
        *[f"- {line}" for line in headline(claims)],
        "",
        claims_markdown(claims),
        "",
        markdown_table(summary(runs), start_row(runs)),
        "",
        COLUMN_NOTES,
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demo_dir", type=Path, help="a finished `bapo demo --out DIR` folder")
    parser.add_argument("--write", type=Path, help="replace the block between the markers in this file")
    parser.add_argument("--command", default="bapo demo", help="the command that made the run, quoted in the block")
    args = parser.parse_args()
    block = demo_tables(args.demo_dir, args.command)
    if not args.write:
        print(block)
        return
    try:
        args.write.write_text(replace_block(args.write.read_text(), START, END, block, str(args.write)))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote the demo tables into {args.write}")


if __name__ == "__main__":
    main()
