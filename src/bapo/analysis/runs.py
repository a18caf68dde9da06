"""Reading finished runs back: metrics.jsonl rows, what each run was, its final evaluation.

A run directory holds `metrics.jsonl` (one JSON object per update, written by bapo.train);
the demo adds `demo_run.json` ({"method", "setting", "seed"}) and `final_eval.json`.
Runs made by plain `bapo train` have no demo_run.json: their identity is read from the
trainer's config.yaml when present, else from the directory name.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bapo.train.metrics import read_metrics


@dataclass
class Run:
    path: Path
    method: str
    setting: str  # the panel it belongs to, e.g. "staleness 4" or "partial rollout"
    seed: int
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl, in order
    final: dict = field(default_factory=dict)       # final_eval.json ({} when absent)

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of every row that has a finite `key`."""
        pts = [(r.get("step", i), r[key]) for i, r in enumerate(self.rows)
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [p[0] for p in pts], [p[1] for p in pts]

    def tail_mean(self, key: str, share: float = 0.2) -> float:
        """Mean of `key` over the last `share` of the rows that have it (nan when none)."""
        _, values = self.series(key)
        if not values:
            return math.nan
        tail = values[-max(1, int(len(values) * share)):]
        return sum(tail) / len(tail)


def _identity(run_dir: Path) -> tuple[str, str, int]:
    info_file = run_dir / "demo_run.json"
    if info_file.exists():
        info = json.loads(info_file.read_text())
        return info["method"], info["setting"], int(info.get("seed", 0))
    config_file = run_dir / "config.yaml"
    if config_file.exists():
        import yaml

        cfg = yaml.safe_load(config_file.read_text()) or {}
        method = cfg.get("loss", {}).get("method", run_dir.name)
        if cfg.get("rollout", {}).get("segment_tokens"):
            setting = "partial rollout"
        else:
            setting = f"staleness {cfg.get('offpolicy', {}).get('staleness', 0)}"
        return method, setting, int(cfg.get("run", {}).get("seed", 0))
    return run_dir.name, "runs", 0


def load_run(run_dir: Path) -> Run:
    run_dir = Path(run_dir)
    method, setting, seed = _identity(run_dir)
    final_file = run_dir / "final_eval.json"
    final = json.loads(final_file.read_text()) if final_file.exists() else {}
    return Run(run_dir, method, setting, seed, read_metrics(run_dir), final)


def find_runs(paths: list[Path]) -> list[Run]:
    """Every run under `paths`: a path is a run (has metrics.jsonl) or holds runs below it."""
    found = []
    for p in map(Path, paths):
        files = [p / "metrics.jsonl"] if (p / "metrics.jsonl").exists() \
            else sorted(p.rglob("metrics.jsonl"))
        found += [load_run(f.parent) for f in files]
    if not found:
        raise FileNotFoundError(f"no metrics.jsonl under {', '.join(map(str, paths))}")
    return found


METHOD_ORDER = ("grpo", "clip-higher", "dual-clip", "topr", "dcpo", "bapo")


def _setting_key(setting: str):
    """staleness settings by number, then everything else (partial rollout, ...) by name."""
    head, _, tail = setting.rpartition(" ")
    return (0, head, int(tail), "") if tail.isdigit() else (1, "", 0, setting)


def _method_key(method: str):
    return (METHOD_ORDER.index(method), "") if method in METHOD_ORDER else (len(METHOD_ORDER), method)


def group_runs(runs: list[Run]) -> dict[str, dict[str, list[Run]]]:
    """{setting: {method: [runs, by seed]}}: staleness ascending, methods in METHOD_ORDER."""
    groups: dict[str, dict[str, list[Run]]] = {}
    for run in sorted(runs, key=lambda r: (_setting_key(r.setting), _method_key(r.method), r.seed)):
        groups.setdefault(run.setting, {}).setdefault(run.method, []).append(run)
    return groups


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
