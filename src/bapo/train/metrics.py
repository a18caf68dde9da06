"""Where metrics go: RUN_DIR/metrics.jsonl (one row per optimizer update), TensorBoard when
installed, and a live progress display (rich bar, a caller's callback, or nothing)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

# fields that differ between two runs of the same config (resume tests ignore them)
TIMING_PREFIXES = ("time/", "tokens_per_s")

ProgressFn = Callable[[int, int, dict], None]


def is_timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES)


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep it readable ("nan", "inf")
    return value


def _row_line(row: dict) -> str:
    return json.dumps({k: _json_value(v) for k, v in row.items()}) + "\n"


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl, in order. A line that does not parse (the partial last
    line of a run killed mid-write) is skipped, so a killed run can still be read and resumed."""
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLog:
    def __init__(self, run_dir: Path, tensorboard: str = "auto", resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # rows written after the checkpoint we resume from are replayed: drop them
            rows = [row for row in read_metrics(run_dir) if row["step"] <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(_row_line(row) for row in rows))
            os.replace(tmp, self.path)  # a kill now leaves the old file, never half of it
        elif resume_step is None:
            self.path.write_text("")
        self.file = self.path.open("a")
        self.writer = None
        if tensorboard != "off":
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                if tensorboard == "on":
                    raise RuntimeError("run.tensorboard=on needs the tensorboard package (pip install bapo[tensorboard])")

    def write(self, row: dict) -> None:
        self.file.write(_row_line(row))
        self.file.flush()
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


class RichProgress:
    """A rich bar over optimizer updates showing reward, entropy and the bounds in effect."""

    def __init__(self, total: int, done: int = 0, title: str = "bapo train"):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self.task = self.progress.add_task(title, total=total, completed=done, info="")
        self.progress.start()

    def __call__(self, step: int, total: int, row: dict) -> None:
        info = (f"reward {row.get('reward/mean', float('nan')):.3f}  entropy {row.get('entropy', float('nan')):.3f}  "
                f"bounds [{row.get('lower', float('nan')):.2f}, {row.get('upper', float('nan')):.2f}]")
        self.progress.update(self.task, completed=step, info=info)

    def close(self) -> None:
        self.progress.stop()
