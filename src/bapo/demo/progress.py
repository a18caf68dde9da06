"""One rich progress bar for the whole demo (warm start + every run), with an ETA.

The bar counts work in "update equivalents": an RL update is 1, an SFT step SFT_STEP_COST
(measured ratio of their wall times), so rich's speed-based ETA stays about right while the
demo moves from the warm start to the runs.
"""

from __future__ import annotations

SFT_STEP_COST = 0.15  # one SFT step (64 x ~30 tokens) / one RL update (128 rollouts + update)


class DemoProgress:
    def __init__(self, plan, specs, enabled: bool = True):
        from bapo.demo.warmstart import cache_root

        cached = (cache_root() / f"warmstart-{plan.warmstart.key()}" / "warmstart.json").exists()
        self.sft_total = 0 if cached else plan.warmstart.sft.steps
        self.updates = {s.name: 0 for s in specs}
        self.steps_per_run = plan.rollout_steps
        self.sft_done_steps = 0
        self.enabled = enabled
        self.bar = None
        self.label = "warm start (SFT)" if self.sft_total else "starting"

    # -- rich plumbing ----------------------------------------------------------------------
    def __enter__(self):
        if self.enabled:
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

    def _refresh(self):
        if self.bar is not None:
            done = self.sft_done_steps * SFT_STEP_COST + sum(self.updates.values())
            self.bar.update(self.task, completed=done, label=self.label)

    # -- events -----------------------------------------------------------------------------
    def sft_step(self, step: int, loss: float) -> None:
        self.sft_done_steps = step + 1
        self.label = f"warm start (SFT) {step + 1}/{self.sft_total}  loss {loss:.3f}"
        self._refresh()

    def sft_done(self) -> None:
        self.sft_done_steps = self.sft_total
        self._refresh()

    def start_run(self, spec) -> None:
        self.label = spec.name
        self._refresh()

    def run_step(self, name: str, done: int) -> None:
        self.updates[name] = done
        running = [n for n, d in self.updates.items() if 0 < d < self.steps_per_run]
        finished = sum(d >= self.steps_per_run for d in self.updates.values())
        self.label = (", ".join(running) or name) + f"  ({finished}/{len(self.updates)} runs done)"
        self._refresh()

    def finishing(self) -> None:
        self.label = "plots and report"
        self._refresh()
