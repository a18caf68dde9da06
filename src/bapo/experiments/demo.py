"""`bapo demo`: the mechanism lab, then the paper's staleness-E comparison on a tiny LLM.

lab (bapo.lab.run_lab, exact softmax dynamics) -> warm start (cached) -> one bapo.train run per
(method, setting, seed) -> claims table, plots, per-run table (bapo.analysis, from the runs'
metrics.jsonl alone). Two off-policy axes, named as the paper and the report name them:
  staleness E   the paper's: E+1 optimizer updates per rollout batch (Algorithm 1; in
                `bapo train`: offpolicy.mini_batches=E+1). The primary axis.
  async delay   a FIFO delay: each batch trained once, k rollout steps after it was generated
                (`bapo train`: offpolicy.async_delay=k). The second axis (--full).
All of it lands in runs/demo-<timestamp>/:
    lab/                           the lab's own folder (claims.json, report.md, cells/)
    data/{train,heldout}.jsonl     the task split the runs used
    <method>-<setting>-seed<s>/    metrics.jsonl (+ demo_run.json, config.yaml)
    plots/*.png, report.md, claims.json, demo.json (plan, timings, CPU seconds)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bapo.experiments.harness import (
    HeldOutHook,
    RunSpec,
    config_from_overrides,
    plan_from,
    quiet_hf,
    run_overrides,
    run_pool,
    train_run,
)
from bapo.experiments.task import make_split, verify
from bapo.experiments.warmstart import WarmStartConfig, warm_start, warmstart_info
from bapo.train.data import read_jsonl, write_jsonl

VERIFIER = "bapo.experiments.task:verify"
# methods whose loss is the same clipped surrogate: on-policy (E=0, no delay) every ratio is
# exactly 1, nothing is clipped, so their runs are identical and one run stands for them all
CLIPPED_SURROGATES = ("grpo", "clip-higher", "dual-clip", "bapo")
# the peer losses of bapo.core.peers (docs/CORE.md), each at its defaults: `bapo train` runs every
# one as loss.method=<name> (decoupled-ppo with the proximal policy it keeps); --full adds them
PEERS = (
    "gspo",
    "cispo",
    "cispo-verl",
    "sapo",
    "gmpo",
    "clip-cov",
    "kl-cov",
    "m2po",
    "m2po-official",
    "decoupled-ppo",
    "dppo-tv",
    "dppo-kl",
)


@dataclass(frozen=True)
class DemoPlan:
    """What a demo profile runs. Sizes were chosen so that on-policy GRPO improves held-out
    accuracy on the built-in task within `rollout_steps` rollout steps (measured, see docs/DEMO.md)."""

    methods: tuple[str, ...] = CLIPPED_SURROGATES
    staleness_e: tuple[int, ...] = (0, 2, 4)  # the paper's E: E+1 updates per rollout batch
    async_delays: tuple[int, ...] = ()  # FIFO delays k (at E=0), the second axis
    partial_rollout: bool = False  # at E=0
    # 5 seeds, 16 samples per held-out prompt: with 3 seeds x 8 samples the headline verdict flipped
    # between two clones (t_0.975 is 4.30 at 2 degrees of freedom, 2.78 at 4)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    rollout_steps: int = 30  # per run (optimizer updates = rollout_steps x (E+1))
    prompts_per_batch: int = 15  # 15 x 8 = 120 responses: divisible by E+1 = 1, 2, 3, 4, 5, 6, 8
    group_size: int = 8
    segment_tokens: int = 8  # partial rollout: new tokens per generation pass
    lr: float = 1e-4  # 3e-4 and 1e-3 lowered held-out accuracy on-policy (measured, docs/DEMO.md)
    bapo_target: float = 0.4  # the paper's rho0, not tuned here
    eval_every: int = 10  # rollout steps between held-out checks during training
    eval_prompts: int = 64  # held-out prompts in those checks ...
    eval_k_during: int = 4  # ... with this many samples each
    final_k: int = 16  # final held-out avg@k / pass@k on every held-out prompt
    lab: str = "default"  # bapo lab profile run first: default | quick | off
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)

    @property
    def max_new_tokens(self) -> int:
        return self.warmstart.task.max_new_tokens

    def runs(self) -> list[RunSpec]:
        """Every run; at E=0 without delay the clipped surrogates share one run (see
        CLIPPED_SURROGATES), named after the first of them."""
        specs: list[RunSpec] = []
        for seed in self.seeds:
            shared = [method for method in self.methods if method in CLIPPED_SURROGATES]
            for staleness_e in self.staleness_e:
                methods = (
                    self.methods if staleness_e else [method for method in self.methods if method not in shared[1:]]
                )
                specs += [RunSpec(method, staleness_e, 0, False, seed) for method in methods]
            for delay in self.async_delays:
                specs += [RunSpec(method, 0, delay, False, seed) for method in self.methods]
            if self.partial_rollout:
                specs += [RunSpec(method, 0, 0, True, seed) for method in self.methods]
        return specs


PROFILES = {
    "quick": DemoPlan(
        methods=("grpo", "bapo"),
        staleness_e=(0, 4),
        seeds=(0, 1, 2),
        rollout_steps=20,
        final_k=8,
        lab="quick",
        eval_every=20,
        eval_prompts=32,
    ),
    "default": DemoPlan(),
    "full": DemoPlan(
        methods=("grpo", "clip-higher", "dual-clip", "topr", "dcpo", "bapo", *PEERS),
        staleness_e=(0, 2, 4, 7),
        async_delays=(4,),
        partial_rollout=True,
        seeds=(0, 1, 2, 3, 4),
        rollout_steps=40,
    ),
}


def train_config(plan: DemoPlan, spec: RunSpec, model_path: Path, data_path: Path, run_dir: Path):
    """The bapo.train config of one run (the same schema `bapo train` reads from YAML)."""
    overrides = run_overrides(
        plan, spec, model_path=model_path, data_path=data_path, run_dir=run_dir, verifier=VERIFIER
    )
    overrides["loss.bapo.target"] = plan.bapo_target
    if spec.partial_rollout:
        overrides["rollout.segment_tokens"] = plan.segment_tokens
    return config_from_overrides(overrides)


def run_one(
    plan: DemoPlan,
    spec: RunSpec,
    model_path: Path,
    demo_dir: Path,
    start: dict,
    tick: Callable[[int], None] | None = None,
    threads: int | None = None,
) -> tuple[float, float]:
    """Train one run into demo_dir/spec.name; returns (wall seconds, CPU seconds of this process)."""
    run_dir = demo_dir / spec.name
    cfg = train_config(plan, spec, model_path, demo_dir / "data" / "train.jsonl", run_dir)
    heldout = read_jsonl(demo_dir / "data" / "heldout.jsonl")
    hook = HeldOutHook(plan, heldout, cfg.updates_per_batch, start, verify)
    progress = (lambda update, total, row: tick(row["rollout_step"] + 1)) if tick else False
    return train_run(spec, run_dir, cfg, hook, threads=threads, progress=progress)


def _pool_run(plan, spec, model_path, demo_dir, start, threads, queue) -> tuple[str, float, float]:
    """run_pool's entry: one run with `threads` torch threads; progress goes through the queue."""
    wall, cpu = run_one(
        plan, spec, model_path, demo_dir, start, tick=lambda done: queue.put((spec.name, done)), threads=threads
    )
    return spec.name, wall, cpu


def evaluate_start(plan: DemoPlan, model_path: Path, heldout: list[dict]) -> dict:
    """The warm-start model scored exactly as the final policies are (same k, length, seed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bapo.analysis.evaluate import evaluate

    model = AutoModelForCausalLM.from_pretrained(model_path)
    return evaluate(
        model,
        AutoTokenizer.from_pretrained(model_path),
        heldout,
        verify,
        k=plan.final_k,
        max_new_tokens=plan.max_new_tokens,
    )


def _run_lab(plan: DemoPlan, demo_dir: Path) -> tuple[list, Path | None]:
    """The mechanism lab first (bapo.lab.run_lab); ([], None) when the plan skips it or when
    this install has no bapo.lab yet."""
    if plan.lab == "off":
        return [], None
    try:
        from bapo.lab.lab import run_lab
    except ModuleNotFoundError as err:  # only a missing bapo.lab is skipped; its own bugs raise
        if err.name not in ("bapo.lab", "bapo.lab.lab"):
            raise
        return [], None
    return run_lab(demo_dir / "lab", quick=plan.lab == "quick")


def run_demo(
    plan: DemoPlan, out: Path | None = None, jobs: int | None = None, threads: int = 1, show_progress: bool = True
) -> Path:
    """Run the whole demo; returns the demo directory (report.md inside).

    jobs: runs in parallel processes (default: one per CPU core, at most one per run);
    threads: torch threads per process. One thread per process is the default because, on
    2 shared cores, 2 processes x 1 thread took 160 s where 1 x 2 took 180 s, and 2 threads
    slowed 10x whenever other work competed for the cores (OpenMP threads waiting on each other).
    """
    from bapo.analysis.plots import plot_runs
    from bapo.analysis.report import write_report
    from bapo.analysis.run_claims import run_claims
    from bapo.analysis.runs import find_runs
    from bapo.experiments.progress import DemoProgress

    quiet_hf()
    specs = plan.runs()
    jobs = jobs or max(1, min(os.cpu_count() or 1, len(specs)))
    t0 = time.time()
    demo_dir = Path(out) if out else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    demo_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    started = time.time()
    lab_claims, lab_dir = _run_lab(plan, demo_dir)
    timings["lab"] = time.time() - started
    with DemoProgress(plan, specs, enabled=show_progress) as progress:
        import torch

        torch.set_num_threads(threads)
        cpu: dict[str, float] = {}
        started, cpu_started = time.time(), time.process_time()
        model_path = warm_start(plan.warmstart, on_step=progress.sft_step)  # cached: no SFT steps
        timings["warm start"], cpu["warm start"] = time.time() - started, time.process_time() - cpu_started
        info = warmstart_info(model_path)
        train_rows, heldout = make_split(plan.warmstart.task)
        write_jsonl(
            [{"prompt": row["prompt"], "answer": row["answer"]} for row in train_rows],
            demo_dir / "data" / "train.jsonl",
        )
        write_jsonl(heldout, demo_dir / "data" / "heldout.jsonl")
        start_scores = evaluate_start(plan, model_path, heldout)
        progress.sft_done()
        if jobs == 1:
            for spec in specs:
                progress.start_run(spec)
                timings[spec.name], cpu[spec.name] = run_one(
                    plan,
                    spec,
                    model_path,
                    demo_dir,
                    start_scores,
                    tick=lambda done, spec=spec: progress.run_step(spec.name, done),
                )
        else:
            pool_jobs = [(plan, spec, model_path, demo_dir, start_scores, threads) for spec in specs]
            for name, wall, cpu_s in run_pool(_pool_run, pool_jobs, jobs, lambda message: progress.run_step(*message)):
                timings[name], cpu[name] = wall, cpu_s
        progress.finishing()
        runs = find_runs([demo_dir / spec.name for spec in specs])
        claims = run_claims(runs, plan.bapo_target)
        plots = plot_runs(runs, demo_dir / "plots", target_share=plan.bapo_target)
        timings["total"] = time.time() - t0
        header = _report_header(plan, info, timings, cpu, jobs, threads, lab_dir, demo_dir)
        write_report(demo_dir / "report.md", runs, claims, plots, plan.bapo_target, header, lab_claims=lab_claims)
        from bapo.analysis.claims import claims_json
        from bapo.analysis.report import headline

        (demo_dir / "claims.json").write_text(claims_json(list(lab_claims) + claims) + "\n")
        (demo_dir / "demo.json").write_text(
            json.dumps(
                {
                    "plan": asdict(plan),
                    "warmstart": str(model_path),
                    "start_policy": start_scores,
                    "timings_s": timings,
                    "cpu_s": cpu,
                    "jobs": jobs,
                    "threads": threads,
                    "lab": str(lab_dir) if lab_dir else None,
                    "headline": headline(claims, list(lab_claims)),
                },
                indent=2,
                default=str,
            )
        )
    return demo_dir


def _report_header(
    plan: DemoPlan, info: dict, timings: dict, cpu: dict, jobs: int, threads: int, lab_dir: Path | None, demo_dir: Path
) -> list[str]:
    task, model = plan.warmstart.task, plan.warmstart.model
    run_cpu = [seconds for name, seconds in cpu.items() if name != "warm start"]
    lab = (
        f"Lab: [{lab_dir.relative_to(demo_dir)}/report.md]({lab_dir.relative_to(demo_dir)}/report.md) "
        f"({timings['lab']:.0f} s)."
        if lab_dir
        else "Lab: not run (bapo.lab absent or --no-lab)."
    )
    return [
        f"Task: countdown-style guess-and-check, {task.n_numbers} numbers in 1-{task.max_number}, "
        f"one attempt per line, stop at the first hit; a {task.max_new_tokens}-token budget "
        f"(about 3 attempts), so failures run to the budget; {task.n_train} training prompts, "
        f"{task.n_heldout} held-out prompts.",
        f"Policy: Llama {model.layers} layers x {model.hidden_size} hidden, warm-started by "
        f"{plan.warmstart.sft.steps} SFT steps on demonstrations that try the attempts in a "
        f"random order (SFT took {info['sft_seconds']} s when it was trained; cached since).",
        f"RL: {plan.rollout_steps} rollout steps per run, {plan.prompts_per_batch} prompts x "
        f"{plan.group_size} samples at temperature 1.0, lr {plan.lr}; methods "
        f"{', '.join(plan.methods)}; staleness E (E+1 optimizer updates per rollout batch) "
        f"{', '.join(map(str, plan.staleness_e))}"
        + (f"; async delay {', '.join(map(str, plan.async_delays))}" if plan.async_delays else "")
        + ("; partial rollout" if plan.partial_rollout else "")
        + f"; seeds {', '.join(map(str, plan.seeds))}; bapo target share {plan.bapo_target}. "
        "At E=0 without delay every ratio is 1, so grpo, clip-higher, dual-clip and bapo are one "
        "run (listed as grpo).",
        lab,
        f"Wall time: {timings['total']:.0f} s in all (lab {timings['lab']:.0f} s, warm start "
        f"{timings['warm start']:.0f} s, {len(run_cpu)} runs, {jobs} process(es) x {threads} "
        f"torch thread(s)); CPU seconds: warm start {cpu['warm start']:.0f}, runs "
        f"{sum(run_cpu):.0f} summed ({min(run_cpu, default=0):.0f}-{max(run_cpu, default=0):.0f} per run).",
    ]


def plan_for(profile: str, **changes) -> DemoPlan:
    """A profile from PROFILES with some fields replaced (None values are ignored); sft_steps
    replaces the warm start's SFT steps."""
    sft_steps = changes.pop("sft_steps", None)
    plan = plan_from(PROFILES, profile, **changes)
    if sft_steps is not None:
        ws = plan.warmstart
        plan = replace(plan, warmstart=replace(ws, sft=replace(ws.sft, steps=sft_steps)))
    return plan
