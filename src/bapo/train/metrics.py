"""Where metrics go: RUN_DIR/metrics.jsonl (one row per optimizer update), TensorBoard and
Weights & Biases (run.report_to), and a live progress display (a rich bar on a terminal, one
plain line per update otherwise, a caller's callback, or nothing)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bapo.train.config import ConfigError

# fields that differ between two runs of the same config (resume tests ignore them)
TIMING_PREFIXES = ("time/", "tokens_per_s")

ProgressFn = Callable[[int, int, dict], None]  # (optimizer updates done, total updates, row)


def is_timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES)


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep it readable ("nan", "inf")
    return value


def _row_line(row: dict) -> str:
    return json.dumps({key: _json_value(value) for key, value in row.items()}) + "\n"


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl, in order, each with "update" (optimizer updates done)
    and "rollout_step". A line that does not parse (the
    partial last line of a run killed mid-write) is skipped, so a killed run can still be read
    and resumed."""
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLog:
    """metrics.jsonl always; TensorBoard and Weights & Biases when listed in `report_to`.

    tensorboard: "auto" (when installed), "on" (required), "off". wandb runs in whatever mode
    WANDB_MODE says (offline works without network); its run id is kept in RUN_DIR/wandb_id so a
    resumed run continues the same wandb run.
    """

    def __init__(
        self,
        run_dir: Path,
        tensorboard: str = "auto",
        resume_update: int | None = None,
        report_to: tuple[str, ...] = ("jsonl", "tensorboard"),
        config: dict | None = None,
    ):
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        if resume_update is not None and self.path.exists():
            # rows written after the checkpoint we resume from are replayed: drop them
            rows = [row for row in read_metrics(run_dir) if row["update"] <= resume_update]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(_row_line(row) for row in rows))
            os.replace(tmp, self.path)  # a kill now leaves the old file, never half of it
        elif resume_update is None:
            self.path.write_text("")
        self.file = self.path.open("a")
        self.writer = None
        if tensorboard != "off" and ("tensorboard" in report_to or tensorboard == "on"):
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                if tensorboard == "on":
                    raise ConfigError(
                        "run.tensorboard=on needs the tensorboard package: pip install 'bapo[tensorboard]', "
                        "or set run.tensorboard=auto"
                    ) from None
        self.wandb = None
        if "wandb" in report_to:
            self.wandb = _start_wandb(run_dir, config or {}, resumed=resume_update is not None)

    def write(self, row: dict) -> None:
        self.file.write(_row_line(row))
        self.file.flush()
        scalars = {key: value for key, value in row.items() if isinstance(value, (int, float)) and key != "update"}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, row["update"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["update"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(run_dir: Path, config: dict, resumed: bool):
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "run.report_to lists wandb, which is not installed: pip install 'bapo[wandb]', "
            "or remove wandb from run.report_to"
        ) from None
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if resumed and id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "bapo"),
        name=run_dir.name,
        id=run_id,
        dir=str(run_dir),
        config=config,
        resume="allow",
    )


class NoSignalWarning:
    """Warns (at most once per `every` updates) when a fresh rollout batch carries no learning
    signal: every group has zero reward variance (all advantages 0), or every response hit
    rollout.max_new_tokens. Reads the metrics row of the update; returns the message or None."""

    def __init__(self, groups_per_batch: int, every: int = 10):
        self.groups_per_batch, self.every = groups_per_batch, every
        self.last: int | None = None

    def check(self, row: dict) -> str | None:
        if not self.every or (self.last is not None and row["update"] - self.last < self.every):
            return None
        zero = row.get("groups/zero_variance", 0)
        truncated = row.get("rollout/response_length/truncated_frac", 0.0)
        if truncated >= 1.0:
            why = (
                "every response was cut at rollout.max_new_tokens before it ended: raise "
                "rollout.max_new_tokens, or ask for shorter answers in the prompt (data.system_prompt)"
            )
        elif zero >= self.groups_per_batch:
            reward = row.get("rollout/reward/mean")
            mean = f" (mean reward {reward:.2f})" if isinstance(reward, (int, float)) else ""
            why = (
                f"every group has the same reward for all its responses{mean}, so "
                "every advantage is 0: check that the prompt asks for the format the verifier reads "
                "(e.g. \\boxed{} for reward.verifier=math), that data.chat_template matches the model, "
                "and that the task is neither too easy nor too hard"
            )
        else:
            return None
        self.last = row["update"]
        return f"update {row['update']}: no learning signal in this rollout batch: {why}"


# -- progress -----------------------------------------------------------------------------------
def _fmt(row: dict, key: str, spec: str = ".3f") -> str:
    value = row.get(key)
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def update_summary(row: dict) -> str:
    """The few numbers a person watches: reward, accuracy, entropy, bounds, positive share, tokens/s."""
    return (
        f"reward {_fmt(row, 'reward/mean')}  acc {_fmt(row, 'accuracy')}  entropy {_fmt(row, 'entropy')}  "
        f"bounds [{_fmt(row, 'lower', '.2f')}, {_fmt(row, 'upper', '.2f')}]  "
        f"share {_fmt(row, 'positive_share')}  tok/s {_fmt(row, 'tokens_per_s', '.0f')}"
    )


class RichProgress:
    """A rich bar over optimizer updates; `status` says what runs now (warm-up, rollout, update)."""

    def __init__(self, total: int, done: int = 0, title: str = "bapo train"):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            TextColumn("[dim]{task.fields[doing]}"),
        )
        self.task = self.progress.add_task(title, total=total, completed=done, info="", doing="starting")
        self.progress.start()

    def status(self, text: str) -> None:
        self.progress.update(self.task, doing=text)

    def __call__(self, update: int, total: int, row: dict) -> None:
        self.progress.update(self.task, completed=update, info=update_summary(row))

    def close(self) -> None:
        self.progress.stop()


class PlainProgress:
    """One plain line per optimizer update (and one per warm-up rollout) for a log file, nohup
    or a cluster job, where a rich bar would only appear at the end."""

    def __init__(self, total: int, done: int = 0, stream=None):
        self.total, self.start_done = total, done
        self.stream = stream or sys.stdout
        self.started = time.perf_counter()

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def status(self, text: str) -> None:
        if text.startswith("warm-up"):  # per-update lines cover the rest
            self._print(text)

    def __call__(self, update: int, total: int, row: dict) -> None:
        done = update - self.start_done
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (total - update) if done > 0 else float("nan")
        eta_text = f"{int(eta // 60)}m{int(eta % 60):02d}s" if math.isfinite(eta) else "-"
        self._print(f"update {update}/{total}  {update_summary(row)}  eta {eta_text}")

    def close(self) -> None:
        pass


def make_progress(total: int, done: int = 0):
    """A rich bar on a terminal, plain lines otherwise."""
    return RichProgress(total, done) if sys.stdout.isatty() else PlainProgress(total, done)
