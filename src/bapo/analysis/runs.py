"""Reading finished runs back: metrics.jsonl rows, what each run was, its final evaluation.

A run directory holds `metrics.jsonl` (one JSON object per optimizer update, written by bapo.train,
with "update" and "rollout_step");
held-out scores are rows' `heldout/avg@k`, `heldout/pass@k` (the demo's hook writes them; the
last row that has them is the final policy's). The demo adds `demo_run.json`
({"method", "setting", "seed"}); a `bapo lab` cell holds every seed's rows in one file, each naming
its cell, method, E, async_delay and seed (`load_runs` splits it by seed).
Runs made by plain `bapo train` have no demo_run.json: their identity is read from the
trainer's config.yaml when present, else from the directory name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from bapo.train.metrics import read_metrics

# Metric names of the committed study records (docs/study/full) -> today's (the trainer's schema):
# the one place they are mapped, so that every reader of finished runs (plots, report, claims) sees
# one name.
LEGACY_METRICS = {
    # optimizer updates between a token's behaviour policy and the update (was named like the paper's E)
    "staleness/mean": "policy_lag/mean",
    "staleness/max": "policy_lag/max",
}


def upgrade_names(row: dict) -> dict:
    """`row` with its LEGACY_METRICS keys renamed (a key whose new name is also there is dropped)."""
    if not LEGACY_METRICS.keys() & row.keys():
        return row
    return {
        LEGACY_METRICS.get(key, key): value
        for key, value in row.items()
        if not (key in LEGACY_METRICS and LEGACY_METRICS[key] in row)
    }


def setting_name(staleness_e: int = 0, async_delay: int = 0, partial_rollout: bool = False) -> str:
    """The panel a run belongs to: "E=2" (the paper's staleness E: E+1 optimizer updates per
    rollout batch), ", async delay 4" (FIFO delay in rollout steps), ", partial rollout"."""
    parts = [f"E={staleness_e}"]
    if async_delay:
        parts.append(f"async delay {async_delay}")
    if partial_rollout:
        parts.append("partial rollout")
    return ", ".join(parts)


@dataclass
class Run:
    path: Path
    method: str
    setting: str  # the panel it belongs to: setting_name(...), e.g. "E=2" or "E=0, async delay 4"
    seed: int
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl, in order

    def series(self, key: str, x: str = "update") -> tuple[list[float], list[float]]:
        """(x values, values) of every row that has a finite `key`; x "update" is the number of
        optimizer updates done, "rollout_step" the rollout step (rows of one rollout step share it)."""
        points = [
            (row.get(x, index), row[key])
            for index, row in enumerate(self.rows)
            if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])
        ]
        return [point[0] for point in points], [point[1] for point in points]

    def values(self, key: str) -> list[float]:
        return self.series(key)[1]

    def tail_mean(self, key: str, share: float = 0.2) -> float:
        """Mean of `key` over the last `share` of the rows that have it (nan when none)."""
        values = self.values(key)
        if not values:
            return math.nan
        tail = values[-max(1, int(len(values) * share)) :]
        return sum(tail) / len(tail)

    def head_mean(self, key: str, share: float = 0.1) -> float:
        """Mean of `key` over the first `share` of the rows that have it (nan when none)."""
        values = self.values(key)
        return (
            sum(values[: max(1, int(len(values) * share))]) / max(1, int(len(values) * share)) if values else math.nan
        )

    def mean(self, key: str) -> float:
        values = self.values(key)
        return sum(values) / len(values) if values else math.nan

    def heldout(self, prefix: str = "heldout/") -> dict:
        """{"k", "avg@k", "pass@k"} from the last metrics row that has `prefix`avg@k ({} if none);
        prefix "heldout/start/" gives the start policy's scores the demo writes on the first row."""
        for row in reversed(self.rows):
            keys = [key for key in row if key.startswith(prefix + "avg@") and "/" not in key[len(prefix) :]]
            if keys:
                samples = int(keys[0].rsplit("@", 1)[1])
                return {
                    "k": samples,
                    f"avg@{samples}": row[keys[0]],
                    f"pass@{samples}": row.get(f"{prefix}pass@{samples}", math.nan),
                }
        return {}

    @property
    def final(self) -> dict:
        return self.heldout()

    def rollout_step_times(self) -> list[dict[str, float]]:
        """One dict per rollout step, from the trainer's timers (bapo.train.trainer): "step_s" the whole
        step (rollout, its optimizer updates and the held-out check that ends some steps), "rollout_s"
        (vLLM sampling "sample_s" and weight push "push_s" where the backend is vLLM, plus the
        trainer's behaviour log-probs and scoring) and "update_s" summed over the step's optimizer
        updates (one row each: E+1 at staleness E). Steps whose rows carry no step timer are left out."""
        by_step: dict[int, list[dict]] = {}
        for row in self.rows:
            if isinstance(row.get("time/rollout_step_s"), (int, float)):
                by_step.setdefault(row["rollout_step"], []).append(row)
        timers = {"step_s": "time/rollout_step_s", "rollout_s": "time/rollout_s"}
        timers |= {"sample_s": "time/vllm_sample_s", "push_s": "time/vllm_push_s"}
        steps = []
        for rows in by_step.values():
            first = rows[0]  # the step's own timers repeat on each of its rows
            step = {name: float(first[key]) for name, key in timers.items() if isinstance(first.get(key), (int, float))}
            updates = [row["time/update_s"] for row in rows if isinstance(row.get("time/update_s"), (int, float))]
            if updates:
                step["update_s"] = float(sum(updates))
            steps.append(step)
        return steps


def step_time_summary(steps: list[dict[str, float]]) -> dict[str, float]:
    """Medians over these rollout steps (Run.rollout_step_times, of one or many runs) of each timer,
    and "push_share": the median over steps of push_s / step_s (each step's own share)."""
    import statistics

    names = sorted({name for step in steps for name in step})
    summary = {name: statistics.median(step[name] for step in steps if name in step) for name in names}
    shares = [step["push_s"] / step["step_s"] for step in steps if "push_s" in step and step.get("step_s")]
    if shares:
        summary["push_share"] = statistics.median(shares)
        summary["push_share_max"] = max(shares)
    return summary


def _identity(run_dir: Path) -> tuple[str, str, int]:
    info_file = run_dir / "demo_run.json"
    if info_file.exists():
        info = json.loads(info_file.read_text())
        return info["method"], info["setting"], int(info.get("seed", 0))
    config_file = run_dir / "config.yaml"
    if config_file.exists():
        import yaml

        from bapo.train.config_io import upgrade_run_config

        cfg = upgrade_run_config(yaml.safe_load(config_file.read_text()) or {})
        method = cfg.get("loss", {}).get("method", run_dir.name)
        offpolicy = cfg.get("offpolicy", {})
        setting = setting_name(
            offpolicy.get("mini_batches", 1) * offpolicy.get("epochs", 1) - 1,
            offpolicy.get("async_delay", 0),
            bool(cfg.get("rollout", {}).get("segment_tokens")),
        )
        return method, setting, int(cfg.get("run", {}).get("seed", 0))
    return run_dir.name, "runs", 0


def load_runs(run_dir: Path) -> list[Run]:
    """The runs of one metrics.jsonl: the run of RUN_DIR, or for a `bapo lab` cell (LAB_DIR/cells/
    <cell>, rows naming their "cell", "method", "E", "async_delay", "seed") one run per seed."""
    run_dir = Path(run_dir)
    rows = [upgrade_names(row) for row in read_metrics(run_dir)]
    if not (rows and all(key in rows[0] for key in ("cell", "seed", "E", "async_delay"))):
        return [Run(run_dir, *_identity(run_dir), rows)]
    rows_by_seed: dict[int, list[dict]] = {}
    for row in rows:
        rows_by_seed.setdefault(int(row["seed"]), []).append(row)
    return [
        Run(run_dir, rows[0]["method"], setting_name(rows[0]["E"], rows[0]["async_delay"]), seed, rows)
        for seed, rows in rows_by_seed.items()
    ]


def find_runs(paths: list[Path]) -> list[Run]:
    """Every run under `paths`: a path is a run (has metrics.jsonl) or holds runs below it; a lab
    cell (its rows name their cell and seed) gives one run per seed."""
    found = []
    for path in map(Path, paths):
        files = [path / "metrics.jsonl"] if (path / "metrics.jsonl").exists() else sorted(path.rglob("metrics.jsonl"))
        for file in files:
            found += load_runs(file.parent)
    if not found:
        raise FileNotFoundError(f"no metrics.jsonl under {', '.join(map(str, paths))}")
    return found


METHOD_ORDER = ("grpo", "clip-higher", "dual-clip", "topr", "dcpo", "bapo")


def _setting_key(setting: str):
    """By E, then async delay, then partial rollout; anything else after, by name."""
    import re

    staleness_e = re.match(r"E=(\d+)", setting)
    delay = re.search(r"async delay (\d+)", setting)
    return (
        0 if staleness_e else 1,
        int(staleness_e.group(1)) if staleness_e else 0,
        int(delay.group(1)) if delay else 0,
        "partial rollout" in setting,
        setting,
    )


def _method_key(method: str):
    return (METHOD_ORDER.index(method), "") if method in METHOD_ORDER else (len(METHOD_ORDER), method)


def group_runs(runs: list[Run]) -> dict[str, dict[str, list[Run]]]:
    """{setting: {method: [runs, by seed]}}: settings by E then async delay, methods in METHOD_ORDER."""
    groups: dict[str, dict[str, list[Run]]] = {}
    for run in sorted(runs, key=lambda run: (_setting_key(run.setting), _method_key(run.method), run.seed)):
        groups.setdefault(run.setting, {}).setdefault(run.method, []).append(run)
    return groups
