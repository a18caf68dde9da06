"""`bapo demo`: the paper's staleness experiment in miniature, on the built-in task and model.

warm start (cached) -> one bapo.train run per (method, setting, seed), each logging held-out
accuracy during training and a final held-out avg@k / pass@k -> plots -> report.md.
All of it lands in runs/demo-<timestamp>/:
    data/{train,heldout}.jsonl     the task split the runs used
    <method>-<setting>-seed<s>/    metrics.jsonl, demo_run.json, final_eval.json (+ trainer files)
    plots/*.png, report.md, demo.json (the plan, timings, start-policy scores)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from bapo.demo.task import TaskConfig, make_split, write_jsonl
from bapo.demo.warmstart import SFTConfig, WarmStartConfig, warm_start, warmstart_info

VERIFIER = "bapo.demo.task:verify"


@dataclass(frozen=True)
class RunSpec:
    """One training run of the demo: a method under one off-policy setting and seed."""

    method: str
    staleness: int = 0
    partial_rollout: bool = False
    seed: int = 0

    @property
    def setting(self) -> str:
        return "partial rollout" if self.partial_rollout else f"staleness {self.staleness}"

    @property
    def name(self) -> str:
        return f"{self.method}-{self.setting.replace(' ', '')}-seed{self.seed}"


@dataclass(frozen=True)
class DemoPlan:
    """What a demo profile runs; the numbers were tuned for ~0.4M parameters on 2 CPU cores."""

    methods: tuple[str, ...] = ("grpo", "clip-higher", "bapo")
    staleness: tuple[int, ...] = (0, 8)
    seeds: tuple[int, ...] = (0,)
    partial_rollout: bool = False
    steps: int = 80               # rollout steps per run (= optimizer updates)
    prompts_per_batch: int = 16
    group_size: int = 8
    max_new_tokens: int = 32      # the longest worked answer at difficulty 2 is 25 tokens + EOS
    segment_tokens: int = 12      # partial rollout: new tokens per generation pass
    # 1e-3 wrecks the warm start within 20 updates; 4e-4 for 40 updates lowered held-out
    # accuracy (0.29 -> 0.21); 2e-4 for 80 updates keeps or raises it
    lr: float = 2e-4
    # The paper's rho0 = 0.4 sits below the share this task has anyway (~0.49), so the search
    # would never move; 0.5 (pos/neg = 1, the recipe's upper end) keeps it at work.
    bapo_target: float = 0.5
    eval_every: int = 5           # updates between held-out checks during training
    eval_prompts: int = 64        # held-out prompts in those checks ...
    eval_k_during: int = 4        # ... with this many samples each
    final_k: int = 8              # final held-out avg@k / pass@k on every held-out prompt
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)

    def runs(self) -> list[RunSpec]:
        specs = [RunSpec(m, k, False, s) for s in self.seeds for k in self.staleness
                 for m in self.methods]
        if self.partial_rollout:
            specs += [RunSpec(m, 0, True, s) for s in self.seeds for m in self.methods]
        return specs


PROFILES = {
    "quick": DemoPlan(methods=("grpo", "bapo"), steps=20, eval_every=5, eval_prompts=32),
    "default": DemoPlan(),
    "full": DemoPlan(methods=("grpo", "clip-higher", "bapo", "topr", "dcpo"),
                     seeds=(0, 1, 2), partial_rollout=True),
}


def train_config(plan: DemoPlan, spec: RunSpec, model_path: Path, data_path: Path,
                 run_dir: Path):
    """The bapo.train config of one run (the same schema `bapo train` reads from YAML)."""
    from bapo.train import load_config

    overrides = {
        # cpu even where a GPU exists: for 0.4M parameters kernel launches cost more than math
        "model.path": str(model_path), "model.device": "cpu",
        "data.path": str(data_path),
        "rollout.prompts_per_batch": plan.prompts_per_batch,
        "rollout.group_size": plan.group_size,
        "rollout.max_new_tokens": plan.max_new_tokens,
        "reward.verifier": VERIFIER,
        "loss.method": spec.method,
        "loss.bapo.target": plan.bapo_target,
        "offpolicy.staleness": spec.staleness,
        "optim.lr": plan.lr,
        "optim.micro_batch_size": plan.prompts_per_batch * plan.group_size,
        "run.output_dir": str(run_dir), "run.steps": plan.steps, "run.seed": spec.seed,
        "run.checkpoint_every": 0, "run.keep_checkpoints": 1,
        "run.tensorboard": "off", "run.progress": False,
    }
    if spec.partial_rollout:
        overrides["rollout.segment_tokens"] = plan.segment_tokens
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


class HeldOutHook:
    """on_update for bapo.train: held-out accuracy every `eval_every` updates, and the final
    avg@k / pass@k (written to final_eval.json) after the last update."""

    def __init__(self, plan: DemoPlan, heldout: list[dict], run_dir: Path, total: int):
        self.plan, self.heldout, self.run_dir, self.total = plan, heldout, run_dir, total

    def __call__(self, step: int, model, tokenizer) -> dict[str, float]:
        from bapo.analysis.evaluate import evaluate
        from bapo.demo.task import verify

        p, out, done = self.plan, {}, step  # step = optimizer updates done (1, 2, ...)
        if done % p.eval_every == 0 or done == self.total:
            scores = evaluate(model, tokenizer, self.heldout[:p.eval_prompts], verify, k=p.eval_k_during,
                              max_new_tokens=p.max_new_tokens)
            out["heldout/accuracy"] = scores[f"avg@{p.eval_k_during}"]
        if done == self.total:
            final = evaluate(model, tokenizer, self.heldout, verify, k=p.final_k,
                             max_new_tokens=p.max_new_tokens)
            (self.run_dir / "final_eval.json").write_text(json.dumps({"k": p.final_k, **final}))
        return out


def _quiet_hf() -> None:
    """No per-run load / save / dataset bars: they would break the one demo progress bar."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def run_one(plan: DemoPlan, spec: RunSpec, model_path: Path, demo_dir: Path,
            tick: Callable[[int], None] | None = None, threads: int | None = None) -> float:
    """Train one run into demo_dir/spec.name; returns its wall time in seconds."""
    import torch

    from bapo.demo.task import read_jsonl
    from bapo.train import train

    if threads:
        torch.set_num_threads(threads)
        _quiet_hf()  # a fresh worker process
    start = time.time()
    run_dir = demo_dir / spec.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "demo_run.json").write_text(json.dumps(
        {"method": spec.method, "setting": spec.setting, "seed": spec.seed, **asdict(spec)}))
    cfg = train_config(plan, spec, model_path, demo_dir / "data" / "train.jsonl", run_dir)
    heldout = read_jsonl(demo_dir / "data" / "heldout.jsonl")
    progress = (lambda step, total, row: tick(step)) if tick else False
    train(cfg, on_update=HeldOutHook(plan, heldout, run_dir, cfg.total_updates), progress=progress)
    return time.time() - start


def _worker(args) -> tuple[str, float]:
    """Process-pool entry (one run, `threads` torch threads); progress goes through a queue."""
    plan, spec, model_path, demo_dir, queue, threads = args
    seconds = run_one(plan, spec, model_path, demo_dir,
                      tick=lambda done: queue.put((spec.name, done)), threads=threads)
    return spec.name, seconds


def evaluate_start(plan: DemoPlan, model_path: Path, heldout: list[dict]) -> dict:
    """The warm-start model scored exactly as the final policies are (same k, length, seed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bapo.analysis.evaluate import evaluate
    from bapo.demo.task import verify

    model = AutoModelForCausalLM.from_pretrained(model_path)
    return evaluate(model, AutoTokenizer.from_pretrained(model_path), heldout, verify, k=plan.final_k,
                    max_new_tokens=plan.max_new_tokens)


def start_policy_scores(heldout_scores: dict, runs) -> dict:
    """The warm-start model's held-out scores, plus its entropy / reward at the first update."""
    start = dict(heldout_scores)
    for col, key in (("entropy", "entropy"), ("train reward", "reward/mean")):
        firsts = [r.series(key)[1][0] for r in runs if r.series(key)[1]]
        if firsts:
            start[col] = sum(firsts) / len(firsts)
    return start


def run_demo(plan: DemoPlan, out: Path | None = None, jobs: int | None = None, threads: int = 1,
             show_progress: bool = True) -> Path:
    """Run the whole demo; returns the demo directory (report.md inside).

    jobs: runs in parallel processes (default: one per CPU core, at most one per run);
    threads: torch threads per process. One thread per process is the default because, on
    2 shared cores, 2 processes x 1 thread took 160 s where 1 x 2 took 180 s, and 2 threads
    slowed 10x whenever other work competed for the cores (OpenMP threads waiting on each other).
    """
    from bapo.analysis.plots import plot_runs
    from bapo.demo.progress import DemoProgress
    from bapo.analysis.report import write_report
    from bapo.analysis.runs import find_runs

    _quiet_hf()
    specs = plan.runs()
    jobs = jobs or max(1, min(os.cpu_count() or 1, len(specs)))
    t0 = time.time()
    demo_dir = Path(out) if out else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    demo_dir.mkdir(parents=True, exist_ok=True)
    with DemoProgress(plan, specs, enabled=show_progress) as progress:
        import torch

        torch.set_num_threads(threads)
        timings: dict[str, float] = {}
        t = time.time()
        model_path = warm_start(plan.warmstart, on_step=progress.sft_step)  # cached: no steps
        timings["warm start"] = time.time() - t
        info = warmstart_info(model_path)
        train_rows, heldout = make_split(plan.warmstart.task)
        write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows],
                    demo_dir / "data" / "train.jsonl")
        write_jsonl(heldout, demo_dir / "data" / "heldout.jsonl")
        start_scores = evaluate_start(plan, model_path, heldout)
        progress.sft_done()
        if jobs == 1:
            for spec in specs:
                progress.start_run(spec)
                timings[spec.name] = run_one(plan, spec, model_path, demo_dir,
                                             tick=lambda d, s=spec: progress.run_step(s.name, d))
        else:
            timings.update(_run_parallel(plan, specs, model_path, demo_dir, jobs, threads,
                                         progress))
        progress.finishing()
        runs = find_runs([demo_dir])
        plots = plot_runs(runs, demo_dir / "plots", target_share=plan.bapo_target)
        timings["total"] = time.time() - t0
        header = _report_header(plan, info, timings, jobs, threads)
        write_report(demo_dir / "report.md", runs, start_policy_scores(start_scores, runs), plots,
                     plan.bapo_target, header)
        (demo_dir / "demo.json").write_text(json.dumps(
            {"plan": asdict(plan), "warmstart": str(model_path), "start_policy": start_scores,
             "timings_s": timings,
             "jobs": jobs, "threads": threads}, indent=2, default=str))
    return demo_dir


def _run_parallel(plan, specs, model_path, demo_dir, jobs, threads, progress) -> dict:
    import concurrent.futures as cf
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # fork + torch threads can deadlock
    timings = {}
    with ctx.Manager() as manager:
        q = manager.Queue()
        with cf.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_worker, (plan, s, model_path, demo_dir, q, threads))
                       for s in specs]
            pending = set(futures)
            while pending:
                try:
                    name, done = q.get(timeout=0.5)
                    progress.run_step(name, done)
                except queue_mod.Empty:
                    pass
                for f in [f for f in pending if f.done()]:
                    pending.discard(f)
                    name, seconds = f.result()  # re-raises a worker's error here
                    timings[name] = seconds
    return timings


def _report_header(plan: DemoPlan, info: dict, timings: dict, jobs: int, threads: int) -> list[str]:
    task, m = plan.warmstart.task, plan.warmstart.model
    runs = [v for k, v in timings.items() if k not in ("warm start", "total")]
    return [
        f"Task: chained +/- arithmetic, difficulty {task.difficulty} ({task.n_terms} terms, "
        f"operands 1-{task.max_operand}), {task.n_train} training prompts, "
        f"{task.n_heldout} held-out prompts.",
        f"Policy: Llama {m.layers} layers x {m.hidden_size} hidden, warm-started by "
        f"{plan.warmstart.sft.steps} SFT steps on demonstrations with "
        f"{plan.warmstart.sft.slip_rate:.0%} of steps slipped (SFT took {info['sft_seconds']} s "
        "when it was trained; cached since).",
        f"RL: {plan.steps} updates per run, {plan.prompts_per_batch} prompts x "
        f"{plan.group_size} samples, lr {plan.lr}, max {plan.max_new_tokens} new tokens; "
        f"methods {', '.join(plan.methods)}; staleness {', '.join(map(str, plan.staleness))}"
        + ("; partial rollout" if plan.partial_rollout else "")
        + f"; seeds {', '.join(map(str, plan.seeds))}; bapo target share {plan.bapo_target}.",
        f"Wall time: {timings['total']:.0f} s in all (warm start {timings['warm start']:.0f} s, "
        f"runs {sum(runs):.0f} s summed over {len(runs)} runs, {jobs} process(es) x "
        f"{threads} torch thread(s)).",
    ]


def plan_for(profile: str, **changes) -> DemoPlan:
    """A profile from PROFILES with some fields replaced (None values are ignored)."""
    plan = PROFILES[profile]
    changes = {k: v for k, v in changes.items() if v is not None}
    if "sft_steps" in changes:
        ws = plan.warmstart
        plan = replace(plan, warmstart=replace(ws, sft=replace(ws.sft,
                                                                steps=changes.pop("sft_steps"))))
    return replace(plan, **changes)

