"""One rich progress bar for the whole demo (warm start + every run), with an ETA; when stdout is
not a terminal (`make demo > log`, a CI job) a plain line per finished stage and run instead.

The bar counts work in "update equivalents": an RL update is 1, an SFT step SFT_STEP_COST
(measured ratio of their wall times), so rich's speed-based ETA stays about right while the
demo moves from the warm start to the runs.
"""

from __future__ import annotations

import sys
import time

SFT_STEP_COST = 0.15  # one SFT step (64 x ~30 tokens) / one RL update (128 rollouts + update)


class DemoProgress:
    def __init__(self, plan, specs, enabled: bool = True):
        from bapo.experiments.harness import cache_root

        cached = (cache_root() / f"warmstart-{plan.warmstart.key()}" / "warmstart.json").exists()
        self.sft_total = 0 if cached else plan.warmstart.sft.steps
        self.updates = {s.name: 0 for s in specs}
        self.steps_per_run = plan.rollout_steps
        self.sft_done_steps = 0
        self.enabled = enabled
        self.plain = enabled and not sys.stdout.isatty()  # lines for a log instead of a bar
        self.bar = None
        self.label = "warm start (SFT)" if self.sft_total else "starting"
        self.started = time.perf_counter()
        self.reported: set[str] = set()  # runs whose plain "done" line is out

    # -- rich plumbing ----------------------------------------------------------------------
    def __enter__(self):
        self.started = time.perf_counter()
        if self.enabled and not self.plain:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]bapo demo"),
                BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[label]}"),
            )
            total = self.sft_total * SFT_STEP_COST + len(self.updates) * self.steps_per_run
            self.task = self.bar.add_task("demo", total=total, label=self.label)
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def _work(self) -> tuple[float, float]:
        """(done, total) in update equivalents."""
        done = self.sft_done_steps * SFT_STEP_COST + sum(self.updates.values())
        return done, self.sft_total * SFT_STEP_COST + len(self.updates) * self.steps_per_run

    def _refresh(self):
        if self.bar is not None:
            self.bar.update(self.task, completed=self._work()[0], label=self.label)

    def _line(self, text: str) -> None:
        """A plain progress line with elapsed time and ETA (plain mode only)."""
        if not self.plain:
            return
        done, total = self._work()
        elapsed = time.perf_counter() - self.started
        eta = f"{elapsed / done * (total - done) / 60:.1f} min" if done > 0 else "-"
        print(f"bapo demo: {text}  ({elapsed / 60:.1f} min elapsed, eta {eta})", flush=True)

    # -- events -----------------------------------------------------------------------------
    def sft_step(self, step: int, loss: float) -> None:
        self.sft_done_steps = step + 1
        self.label = f"warm start (SFT) {step + 1}/{self.sft_total}  loss {loss:.3f}"
        self._refresh()
        if (step + 1) % max(1, self.sft_total // 4) == 0 and step + 1 < self.sft_total:
            self._line(self.label)

    def sft_done(self) -> None:
        self.sft_done_steps = self.sft_total
        self._refresh()
        self._line("warm start done" if self.sft_total else "warm start cached")

    def start_run(self, spec) -> None:
        self.label = spec.name
        self._refresh()

    def run_step(self, name: str, done: int) -> None:
        self.updates[name] = done
        running = [n for n, d in self.updates.items() if 0 < d < self.steps_per_run]
        finished = sum(d >= self.steps_per_run for d in self.updates.values())
        self.label = (", ".join(running) or name) + f"  ({finished}/{len(self.updates)} runs done)"
        self._refresh()
        if done >= self.steps_per_run and name not in self.reported:
            self.reported.add(name)
            self._line(f"run {name} done, {finished}/{len(self.updates)} runs")

    def finishing(self) -> None:
        self.label = "plots and report"
        self._refresh()
        self._line("every run done; plots and report")
