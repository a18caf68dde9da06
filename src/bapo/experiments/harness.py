"""The harness `bapo demo` and `bapo study` share: what one run is, how a plan becomes bapo.train
configs, the held-out hook, the run's records, child-process runs and resume.

    RunPlan          what the harness reads of a plan (DemoPlan, StudyPlan)
    RunSpec          one run: method, staleness E, async delay k, partial rollout, seed
    plan_from        a profile with some fields replaced
    run_overrides    the bapo.train overrides every run shares; config_from_overrides turns them into a config
    HeldOutHook      held-out scores written into the run's own metrics.jsonl rows
    train_run        one run: its record (demo_run.json), then bapo.train with the hook
    run_in_child     one run in a fresh spawned process (the study: its vLLM engine dies with it)
    run_pool         runs in a pool of spawned processes with a progress queue (the demo)
    is_done, resume_point, mark_done, write_json   records and resume (done.json, checkpoints)
    cache_root       $BAPO_CACHE

A plan is a frozen dataclass that has RunPlan's fields (DemoPlan, StudyPlan); its runs() lists
the RunSpecs it trains, in order.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol


class RunPlan(Protocol):
    """What the harness reads of a plan."""

    prompts_per_batch: int  # per rollout step, each with group_size responses
    group_size: int
    lr: float
    rollout_steps: int  # per run
    eval_every: int  # rollout steps between held-out checks ...
    eval_prompts: int  # ... on this many held-out prompts ...
    eval_k_during: int  # ... with this many samples each
    final_k: int  # final held-out avg@k / pass@k on every held-out prompt

    @property
    def max_new_tokens(self) -> int: ...

    def runs(self) -> list[RunSpec]: ...


def cache_root() -> Path:
    """$BAPO_CACHE (default ~/.cache/bapo): the warm start, the converted SmolLM2, start scores."""
    return Path(os.environ.get("BAPO_CACHE", Path.home() / ".cache" / "bapo"))


@dataclass(frozen=True)
class RunSpec:
    """One training run: a method under one off-policy setting and seed.

    staleness_e is the paper's staleness E (E+1 optimizer updates per rollout batch); async_delay
    the FIFO delay k in rollout steps."""

    method: str
    staleness_e: int = 0
    async_delay: int = 0
    partial_rollout: bool = False
    seed: int = 0

    @property
    def setting(self) -> str:
        parts = [f"E={self.staleness_e}"]
        if self.async_delay:
            parts.append(f"async delay {self.async_delay}")
        if self.partial_rollout:
            parts.append("partial rollout")
        return ", ".join(parts)

    @property
    def name(self) -> str:
        slug = self.setting.replace(", ", "-").replace(" ", "").replace("=", "")
        return f"{self.method}-{slug}-seed{self.seed}"

    def record(self) -> dict:
        """demo_run.json: what bapo.analysis.runs reads as the run's identity."""
        return {"method": self.method, "setting": self.setting, "seed": self.seed, **asdict(self)}


def plan_from(profiles: dict, profile: str, **changes):
    """profiles[profile] with some fields replaced (None values are ignored)."""
    return replace(profiles[profile], **{name: value for name, value in changes.items() if value is not None})


def run_overrides(
    plan: RunPlan, spec: RunSpec, *, model_path: Path, data_path: Path, run_dir: Path, verifier: str
) -> dict:
    """The bapo.train overrides every demo and study run shares: the model and data, the plan's
    rollout size at temperature 1, the method and its off-policy setting (E+1 mini-batches, FIFO
    delay), the seed and a quiet run folder (no tensorboard, no progress bar, no checkpoints).
    cpu even where a GPU exists (the study overrides it): for the demo's 0.4M parameters kernel
    launches cost more than math."""
    return {
        "model.path": str(model_path),
        "model.device": "cpu",
        "data.path": str(data_path),
        "rollout.prompts_per_batch": plan.prompts_per_batch,
        "rollout.group_size": plan.group_size,
        "rollout.max_new_tokens": plan.max_new_tokens,
        "rollout.temperature": 1.0,
        "reward.verifier": verifier,
        "loss.method": spec.method,
        "offpolicy.mini_batches": spec.staleness_e + 1,
        "offpolicy.async_delay": spec.async_delay,
        "optim.lr": plan.lr,
        "optim.micro_batch_size": plan.prompts_per_batch * plan.group_size,
        "run.output_dir": str(run_dir),
        "run.rollout_steps": plan.rollout_steps,
        "run.seed": spec.seed,
        "run.checkpoint_every": 0,
        "run.keep_checkpoints": 1,
        "run.tensorboard": "off",
        "run.progress": False,
    }


def config_from_overrides(overrides: dict):
    """The bapo.train config of these overrides (the same schema `bapo train` reads from YAML)."""
    from bapo.train import load_config

    return load_config(None, [f"{key}={json.dumps(value)}" for key, value in overrides.items()])


class HeldOutHook:
    """on_update for bapo.train, called after each rollout step's updates. It writes into that
    step's metrics row: the start policy's held-out scores on the first row
    (heldout/start/avg@k, pass@k), held-out accuracy every `eval_every` rollout steps
    (heldout/accuracy = avg@eval_k_during, heldout/pass = pass@eval_k_during), and the final
    held-out heldout/avg@k, heldout/pass@k on the last row, so that a run's metrics.jsonl alone
    carries everything the report needs.

    Samples come from HF generate on the hook's
    model (bapo.analysis.evaluate), or from `sampler(prompts, k) -> [len(prompts)][k] texts` when
    set (bapo study: the run's own vLLM engine, Trainer.sample_texts)."""

    def __init__(self, plan: RunPlan, heldout: list[dict], updates_per_batch: int, start: dict, verifier, sampler=None):
        self.plan, self.heldout, self.per_batch, self.start = plan, heldout, updates_per_batch, start
        self.verifier, self.sampler = verifier, sampler

    def _score(self, model, tokenizer, rows: list[dict], k: int) -> dict:
        from bapo.analysis.evaluate import evaluate, score_samples

        if self.sampler is not None:
            return score_samples(self.sampler([row["prompt"] for row in rows], k), rows, self.verifier, k, tokenizer)
        return evaluate(model, tokenizer, rows, self.verifier, k=k, max_new_tokens=self.plan.max_new_tokens)

    def __call__(self, update: int, model, tokenizer) -> dict[str, float]:
        plan, out = self.plan, {}
        rollout_steps_done = update // self.per_batch  # update: optimizer updates done
        if rollout_steps_done == 1:
            out.update({f"heldout/start/{key}": value for key, value in self.start.items() if "@" in key})
        if rollout_steps_done % plan.eval_every == 0 and rollout_steps_done < plan.rollout_steps:
            k = plan.eval_k_during
            scores = self._score(model, tokenizer, self.heldout[: plan.eval_prompts], k)
            out["heldout/accuracy"], out["heldout/pass"] = scores[f"avg@{k}"], scores[f"pass@{k}"]
        if rollout_steps_done == plan.rollout_steps:
            final = self._score(model, tokenizer, self.heldout, plan.final_k)
            out.update({f"heldout/{key}": value for key, value in final.items() if "@" in key})
            out["heldout/accuracy"] = final[f"avg@{plan.final_k}"]
            out["heldout/pass"] = final[f"pass@{plan.final_k}"]
        return out


def quiet_hf() -> None:
    """No per-run load / save / dataset bars: they would break the demo's one progress bar and
    the study's log."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def train_run(
    spec: RunSpec, run_dir: Path, cfg, hook: HeldOutHook, *, threads: int | None = None, **train_options
) -> tuple[float, float]:
    """Train one run into run_dir: its record (demo_run.json), then bapo.train.train(cfg) with the
    held-out hook; train_options go to train (progress, resume, on_start). threads: torch threads
    of this process. Returns (wall seconds, CPU seconds of this process)."""
    import torch

    from bapo.train import train

    if threads:
        torch.set_num_threads(threads)
    wall, cpu = time.time(), time.process_time()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "demo_run.json").write_text(json.dumps(spec.record()))
    train(cfg, on_update=hook, **train_options)
    return time.time() - wall, time.process_time() - cpu


def _in_child(target: Callable, args: tuple):
    quiet_hf()  # a fresh process
    return target(*args)


def run_in_child(target: Callable, *args) -> int:
    """target(*args) in a fresh spawned process (fork + torch threads can deadlock); its exit code."""
    import multiprocessing as mp

    process = mp.get_context("spawn").Process(target=_in_child, args=(target, args))
    process.start()
    process.join()
    return process.exitcode


def run_pool(
    target: Callable, jobs: list[tuple], processes: int, on_progress: Callable[[object], None]
) -> Iterator[object]:
    """target(*job, queue) for every job in a pool of `processes` spawned processes; yields each
    result as it finishes (a worker's error re-raises here). target may put progress messages on
    `queue`; on_progress receives each in this process."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # fork + torch threads can deadlock
    with ctx.Manager() as manager:
        updates_queue = manager.Queue()
        with cf.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
            pending = {pool.submit(_in_child, target, (*job, updates_queue)) for job in jobs}
            while pending:
                try:
                    message = updates_queue.get(timeout=0.5)
                except queue_mod.Empty:
                    pass
                else:
                    on_progress(message)
                for future in [future for future in pending if future.done()]:
                    pending.discard(future)
                    yield future.result()


def write_json(path: Path, value) -> None:
    """Written under a temporary name and renamed: a kill never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


def is_done(run_dir: Path) -> bool:
    """A run is finished when its done.json exists (mark_done writes it last)."""
    return (run_dir / "done.json").exists()


def resume_point(run_dir: Path) -> Path | None:
    """run_dir when it holds a checkpoint to resume from (bapo train's exact resume), else None."""
    from bapo.train.checkpoint import checkpoints

    return run_dir if run_dir.is_dir() and checkpoints(run_dir) else None


def drop_checkpoints(run_dir: Path) -> None:
    """A finished run's checkpoints go (its metrics.jsonl has everything the report reads; a
    SmolLM2 checkpoint is ~1.6 GB)."""
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def mark_done(run_dir: Path, done: dict) -> None:
    """A finished run: its checkpoints go, then done.json (what is_done reads)."""
    drop_checkpoints(run_dir)
    (run_dir / "done.json").write_text(json.dumps(done))
