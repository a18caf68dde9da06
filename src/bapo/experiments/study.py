"""`bapo study`: does BAPO help a real pretrained model on stale data?

SmolLM2-135M-Instruct (`bapo smollm2`, offline) learns the in-house arithmetic task of
bapo.experiments.arith in chat form, with rollout.backend=vllm (the colocated vLLM engine samples;
held-out checks use the same engine, Trainer.sample_texts). One bapo.train run per
(method, setting, seed), judged by the demo's machinery: the claims engine with 95% intervals
(bapo.analysis.run_claims), plots with seed bands, report.md, claims.json.

Methods (METHODS): the full plan's grpo, clip-higher, bapo (bapo's default preset), bapo-paper
(loss.bapo.preset=paper), m2po, decoupled-ppo, and grpo-seq-mean, dppo-tv, icepop, opsm. Settings:
staleness E (the paper's axis: E+1 optimizer updates per rollout batch), async delay k (a FIFO
delay, the axis of M2PO's and AReaL's staleness tables) and partial rollout. On-policy (E=0, no
delay) every ratio is exactly 1 and the clipped losses give GRPO's gradient
(tests/experiments/test_study.py checks it), so they share one grpo run per seed at E=0; the
methods of OWN_ON_POLICY_RUN_METHODS change the on-policy gradient and run their own.

Every run checkpoints; the study folder holds:
    study.json                       the plan (what --resume continues), timings, CPU seconds
    data/{train,heldout}.jsonl       the task split
    start.json                       the start policy's held-out scores (computed once)
    <method>-<setting>-seed<s>/      metrics.jsonl, config.yaml, demo_run.json, done.json
    plots/, report.md, claims.json   rewritten after every finished run (partial studies too)
A run is finished when its done.json exists; `bapo study --resume DIR` skips those and resumes
a started run from its last checkpoint (bapo train's exact resume).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from bapo.experiments.arith import ArithTaskConfig, make_split, operands, task_spec, verify
from bapo.experiments.harness import (
    HeldOutHook,
    RunSpec,
    cache_root,
    config_from_overrides,
    is_done,
    mark_done,
    plan_from,
    resume_point,
    run_in_child,
    run_overrides,
    train_run,
    write_json,
)
from bapo.train.data import read_jsonl, write_jsonl
from bapo.train.precision import emulates_bf16_gemms, native_bf16

VERIFIER = "bapo.experiments.arith:verify"
# study method -> the bapo.train overrides that make it
METHODS: dict[str, dict[str, object]] = {
    "grpo": {"loss.method": "grpo"},
    "clip-higher": {"loss.method": "clip-higher"},
    "bapo": {"loss.method": "bapo", "loss.bapo.preset": "default"},
    "bapo-paper": {"loss.method": "bapo", "loss.bapo.preset": "paper"},
    "m2po": {"loss.method": "m2po"},
    "decoupled-ppo": {"loss.method": "decoupled-ppo"},
    # GRPO weighting every reply equally: a long failing reply no longer outweighs a short correct
    # one, so the length imbalance BAPO answers is removed by construction (the control users ask for)
    "grpo-seq-mean": {"loss.method": "grpo", "loss.agg_mode": "seq-mean-token-mean"},
    # the 2026 peers at their defaults; DPPO with a token mean like every other method here (its
    # paper's seq-mean-token-sum-norm divides by the 64-token budget: ~1/3 of the step at the same lr)
    "dppo-tv": {"loss.method": "dppo-tv", "loss.agg_mode": "token-mean"},
    # IcePop: GRPO whose tokens with trainer / engine probability outside [0.5, 5] are masked
    "icepop": {"loss.method": "grpo", "rollout.correction": "icepop"},
    # OPSM: GRPO dropping a failing reply whose mean log(pi_engine / pi) exceeds 0.5 (TRL's example value)
    "opsm": {"loss.method": "grpo", "loss.off_policy_mask": 0.5},
}
# methods whose on-policy gradient is not GRPO's (another aggregation, the engine-gap weight or
# mask): at E=0 without delay they run their own runs instead of sharing GRPO's
OWN_ON_POLICY_RUN_METHODS = ("grpo-seq-mean", "icepop", "opsm")
# the full plan's methods (the short-reply study, docs/study/full)
FULL_PLAN_METHODS = ("grpo", "clip-higher", "bapo", "bapo-paper", "m2po", "decoupled-ppo")
# the plan in the regime (docs/STUDY.md, "The plan in the regime"), in its `--methods` order
REGIME_PLAN_METHODS = (
    "grpo",
    "bapo",
    "bapo-paper",
    "grpo-seq-mean",
    "clip-higher",
    "m2po",
    "decoupled-ppo",
    "dppo-tv",
    "icepop",
    "opsm",
)
# trained first, on every axis: the paper's comparison (grpo vs bapo, both presets); then the control
HEADLINE_METHODS = ("grpo", "bapo", "bapo-paper")
CONTROL_METHODS = ("grpo-seq-mean",)
# the other methods, each judged against GRPO on held-out accuracy (claim 5) as BAPO is (claim 4)
PEERS = ("clip-higher", "m2po", "decoupled-ppo", "grpo-seq-mean", "dppo-tv", "icepop", "opsm")
BAPO_TARGET = 0.4  # rho0 of both bapo presets (the paper's); not tuned here


@dataclass(frozen=True)
class StudyPlan:
    """What a study runs. Sizes: docs/STUDY.md (measured per-run cost, the lr choice)."""

    methods: tuple[str, ...] = FULL_PLAN_METHODS
    staleness_e: tuple[int, ...] = (0, 4)
    async_delays: tuple[int, ...] = (4, 16)
    # methods also run with partial rollout (at E=0, no delay; grpo among them, their baseline): each
    # rollout step adds at most segment_tokens tokens to every unfinished reply, so a long reply
    # spans policy versions. None: a quarter of the reply budget (16 of 64), resolved and saved
    partial_rollout_methods: tuple[str, ...] = ()
    segment_tokens: int | None = None
    seeds: tuple[int, ...] = (0, 1, 2)
    rollout_steps: int = 20
    # 5 x 8 = 40 responses per rollout step (E=4: 5 mini-batches of 8; bapo train requires E+1 to
    # divide the batch); on the loaded 2-core machine 8 x 8 cost 71 s per rollout step
    prompts_per_batch: int = 5
    group_size: int = 8
    lr: float = 1e-5
    # model.lora.rank of every run (None: full fine-tuning). LoRA as TRL's "LoRA Without Regret" runs
    # GRPO: alpha 32 on every linear layer (bapo train's defaults), with ~10x the full lr (--lr)
    lora_rank: int | None = None
    # rollout and held-out sampling: at 1.0 SmolLM2 (from the Q4_1 GGUF) answers 6% of the task
    # (below the 10-60% start accuracy the study asks for, so that groups have reward variance), at
    # 0.7 15% (docs/STUDY.md)
    temperature: float = 0.7
    eval_every: int = 10  # rollout steps between held-out checks (avg@eval_k_during, pass@...)
    eval_prompts: int = 200
    eval_k_during: int = 2
    # vLLM on 2 shared cores samples ~50-150 tokens/s: 200 x 4 samples cost ~2-4 min per run
    final_k: int = 4
    model: str = "smollm2"  # "smollm2" (bapo smollm2's folder) or a path to an HF folder
    backend: str = "vllm"  # rollout.backend; "hf" in the tests (no vLLM there) and on a GPU without vLLM
    device: str = "cpu"  # model.device of every run ("cuda" in the gpu profile)
    vllm_enforce_eager: bool = False
    # model.autocast of the trainer's forwards: "auto" is resolved when the plan is made (and saved
    # so, so a resumed study keeps it): bfloat16 where the machine computes bf16 natively (weights and
    # optimizer state stay fp32; tests/train/test_autocast.py), else "none": an AVX2-only CPU gains no
    # speed from bf16 (bapo.train.precision runs its GEMMs in fp32 there, so that a bf16 plan resumed
    # on such a machine runs at ~0.5-0.7x fp32's speed, not torch's ~0.1x). None leaves bapo.train's default
    autocast: str | None = "auto"
    checkpoint_every: int = 5
    chat: bool = True  # the model's chat template (the tests' tiny model has none)
    task: ArithTaskConfig = field(default_factory=ArithTaskConfig)
    # on-policy, every method gives grpo's gradient: one grpo run per seed at E=0 (no delay)
    on_policy_shared: bool = True

    def __post_init__(self):
        if self.autocast == "auto":
            object.__setattr__(self, "autocast", "bfloat16" if native_bf16(self.device) else "none")
        if self.autocast not in (None, "none", "bfloat16"):
            raise ValueError(f"autocast={self.autocast!r}: use none, bfloat16 or auto")
        batch = self.prompts_per_batch * self.group_size
        for staleness_e in self.staleness_e:
            if batch % (staleness_e + 1):
                raise ValueError(
                    f"staleness E={staleness_e}: E+1 optimizer updates must divide the rollout batch of "
                    f"{batch} responses (prompts_per_batch x group_size); change prompts_per_batch"
                )
        questions = len(operands(self.task))
        if questions <= self.task.n_heldout:
            raise ValueError(
                f"task {task_spec(self.task)}: {questions} questions, not more than the "
                f"{self.task.n_heldout} held out; widen the operand ranges"
            )
        if self.segment_tokens is None:
            object.__setattr__(self, "segment_tokens", max(1, self.max_new_tokens // 4))
        for name, chosen in (("methods", self.methods), ("partial_rollout_methods", self.partial_rollout_methods)):
            unknown = [method for method in chosen if method not in METHODS]
            if unknown:
                raise ValueError(f"{name}: {', '.join(unknown)} not among {', '.join(METHODS)}")
            repeated = sorted({method for method in chosen if chosen.count(method) > 1})
            if repeated:
                raise ValueError(f"{name}: {', '.join(repeated)} given twice; name each method once")
            engine_only = [method for method in chosen if "rollout.correction" in METHODS[method]]
            if engine_only and self.backend != "vllm":
                raise ValueError(
                    f"{name}: {', '.join(engine_only)} weighs tokens by the vLLM engine's gap, which backend "
                    f"{self.backend} does not have; leave {', '.join(engine_only)} out of this plan"
                )
        if self.partial_rollout_methods and "grpo" not in self.partial_rollout_methods:
            raise ValueError(
                "partial_rollout_methods: add grpo, the baseline the other methods there are judged against"
            )
        if self.partial_rollout_methods and not 0 < self.segment_tokens < self.max_new_tokens:
            raise ValueError(
                f"segment_tokens={self.segment_tokens}: partial rollout needs a segment between 1 and the "
                f"{self.max_new_tokens}-token budget minus 1 (at the budget every reply ends in one pass)"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"temperature={self.temperature}: a finite sampling temperature above 0 is required "
                "(GRPO's groups and avg@k need k different replies), e.g. 0.7 or 1.0"
            )

    @property
    def max_new_tokens(self) -> int:
        return self.task.max_new_tokens

    def runs(self) -> list[RunSpec]:
        """Every run, in the order the study trains them (so that a partial study is a useful
        one): the headline methods (HEADLINE_METHODS) on every axis first, then the control
        (CONTROL_METHODS), then the other peers; within each tier the paper's axis (E) first, then
        each async delay k, then partial rollout, and within each axis seed by seed, so a cell
        finishes with all its seeds before the next axis starts."""
        specs: list[RunSpec] = []
        for staleness_e in self.staleness_e:
            methods = self.on_policy_methods() if staleness_e == 0 else self.methods
            specs += [RunSpec(method, staleness_e, 0, False, seed) for seed in self.seeds for method in methods]
        for delay in self.async_delays:
            specs += [RunSpec(method, 0, delay, False, seed) for seed in self.seeds for method in self.methods]
        partial = self.partial_rollout_methods
        specs += [RunSpec(method, 0, 0, True, seed) for seed in self.seeds for method in partial]
        block = {spec.setting: index for index, spec in enumerate(specs)}
        methods = ("grpo", *self.methods, *partial)

        def order(spec: RunSpec):
            axis = 1 + self.async_delays.index(spec.async_delay) if spec.async_delay else 0
            if spec.partial_rollout:
                axis = 1 + len(self.async_delays)
            tier = 0 if spec.method in HEADLINE_METHODS else 1 if spec.method in CONTROL_METHODS else 2
            return (tier, axis, spec.seed, block[spec.setting], methods.index(spec.method))

        return sorted(specs, key=order)

    def on_policy_methods(self) -> tuple[str, ...]:
        """The methods with runs of their own at E=0 without delay: with on_policy_shared, grpo (the
        run every clipped method shares: their on-policy gradient is GRPO's) and the plan's
        OWN_ON_POLICY_RUN_METHODS; else every method."""
        if not self.on_policy_shared:
            return self.methods
        return ("grpo", *(method for method in self.methods if method in OWN_ON_POLICY_RUN_METHODS))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> StudyPlan:
        known = {spec.name for spec in fields(cls)}
        values = {name: value for name, value in data.items() if name in known}
        values["task"] = ArithTaskConfig(**{**values.get("task", {}), "ops": tuple(values.get("task", {})["ops"])})
        for name in ("methods", "staleness_e", "async_delays", "seeds", "partial_rollout_methods"):
            if name in values:  # partial_rollout_methods: absent from the studies saved before it
                values[name] = tuple(values[name])
        return cls(**values)


# the regime gate (docs/STUDY.md, "The regime gate"): GRPO alone where failing replies are longer
# than correct ones (a 64-token budget: share 0.38-0.42 at ratio 1 at the start, docs/STUDY.md),
# 8 x 8 = 64 responses (E+1 = 2, 4 or 8 divides it), 40 rollout steps. The lr is chosen on
# on-policy runs (`--staleness 0 --delays ''` at each candidate lr), then the stale cells run at it.
_REGIME = StudyPlan(
    methods=("grpo",),
    staleness_e=(0, 3),
    async_delays=(8,),
    rollout_steps=40,
    prompts_per_batch=8,
    eval_every=20,
    eval_prompts=100,
    task=ArithTaskConfig(max_new_tokens=64),
)
PROFILES = {
    "full": StudyPlan(),
    # one seed, two cells (grpo and bapo at E=4, the paper's headline comparison), shorter
    "quick": StudyPlan(
        methods=("grpo", "bapo"),
        staleness_e=(4,),
        async_delays=(),
        seeds=(0,),
        rollout_steps=5,
        eval_every=5,
        final_k=2,
    ),
    "regime": _REGIME,
    # scripts/gpu_study.sh: the plan in the regime (docs/STUDY.md, docs/study/regime-plan: the regime
    # profile with REGIME_PLAN_METHODS, lr 1e-6, E 0,3, delay 8, partial grpo,bapo, 5 seeds) moved to
    # one CUDA device with HF rollout (its machine has no vLLM), so without icepop, whose weight is the
    # vLLM engine's gap. Same batch, budget, lr, held-out protocol and bf16 autocast as the CPU plan:
    # the two studies differ in device and rollout engine only. Checkpoints every 10 rollout steps
    # (a lent GPU machine is fresh each time: a run cut off there starts over anyway).
    "gpu": replace(
        _REGIME,
        methods=tuple(method for method in REGIME_PLAN_METHODS if method != "icepop"),
        seeds=(0, 1, 2, 3, 4),
        lr=1e-6,
        partial_rollout_methods=("grpo", "bapo"),
        backend="hf",
        device="cuda",
        autocast="bfloat16",
        checkpoint_every=10,
    ),
}


def model_path(plan: StudyPlan) -> Path:
    """The plan's model folder; "smollm2" must have been resolved by the caller (the CLI converts
    it with `bapo smollm2`'s converter, which lives above this layer)."""
    if plan.model == "smollm2":
        raise ValueError("model='smollm2': pass the folder of `bapo smollm2` (bapo study resolves it)")
    return Path(plan.model)


def train_config(plan: StudyPlan, spec: RunSpec, model: Path, study_dir: Path, run_dir: Path):
    """The bapo.train config of one study run (the same schema `bapo train` reads from YAML)."""
    overrides = run_overrides(
        plan, spec, model_path=model, data_path=study_dir / "data" / "train.jsonl", run_dir=run_dir, verifier=VERIFIER
    )
    overrides.update(METHODS[spec.method])
    overrides.update(
        {
            "rollout.temperature": plan.temperature,
            "data.chat_template": plan.chat,
            "data.system_prompt": plan.task.system_prompt,
            "data.max_prompt_tokens": 64,
            "rollout.backend": plan.backend,
            "model.device": plan.device,
            "optim.micro_batch_size": 16,
            "optim.warmup_updates": 0,
            "run.checkpoint_every": plan.checkpoint_every,
            "run.keep_checkpoints": 1,
        }
    )
    if plan.backend == "vllm":
        overrides["rollout.vllm_enforce_eager"] = plan.vllm_enforce_eager
    if plan.autocast is not None:
        overrides["model.autocast"] = plan.autocast
    if plan.lora_rank is not None:
        overrides["model.lora.rank"] = plan.lora_rank
    if spec.partial_rollout:
        overrides["rollout.segment_tokens"] = plan.segment_tokens
    return config_from_overrides(overrides)


def _start_scores(trainer, plan: StudyPlan, heldout: list[dict], path: Path) -> dict:
    """The start policy's held-out scores, computed once (before any update, with the run's own
    sampler) and kept in the study's start.json. The same model, held-out set, k, budget,
    temperature, backend and device give the same draw (seeded), so they are also kept in
    $BAPO_CACHE/study-start/<key>.json and a new study with them reuses the score."""
    import hashlib

    from bapo.analysis.evaluate import score_samples

    if path.exists():
        return json.loads(path.read_text())
    drawn_with = (plan.final_k, plan.max_new_tokens, plan.temperature, plan.backend, plan.device, plan.chat)
    key = json.dumps([str(model_path(plan)), heldout, *drawn_with])
    cached = cache_root() / "study-start" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if cached.exists():
        scores = json.loads(cached.read_text())
    else:
        samples = trainer.sample_texts([row["prompt"] for row in heldout], plan.final_k)
        scores = score_samples(samples, heldout, verify, plan.final_k, trainer.tokenizer)
        write_json(cached, scores)
    write_json(path, scores)
    return scores


def run_one(plan: StudyPlan, spec: RunSpec, study_dir: Path, threads: int | None = None) -> dict:
    """Train (or resume, from its last checkpoint) one run into study_dir/spec.name; marks it done
    (done.json, checkpoints removed) when it finishes. Returns done.json's content: wall and CPU
    seconds of this sitting (this process; vLLM runs in it), whether it resumed and, under bf16
    autocast, which GEMMs gave its bf16 in this sitting: torch's, or bapo.train.precision's fp32 ones."""
    run_dir = study_dir / spec.name
    resume = resume_point(run_dir)
    cfg = train_config(plan, spec, model_path(plan), study_dir, run_dir)
    if resume is None:  # a run killed before its first checkpoint starts over
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"overwrite": True})})
    heldout = read_jsonl(study_dir / "data" / "heldout.jsonl")
    hook = HeldOutHook(plan, heldout, cfg.updates_per_batch, {}, verify)

    def bind(trainer) -> None:
        hook.sampler = lambda prompts, k: trainer.sample_texts(prompts, k)
        hook.start = _start_scores(trainer, plan, heldout, study_dir / "start.json")

    wall, cpu = train_run(spec, run_dir, cfg, hook, threads=threads, progress=False, resume=resume, on_start=bind)
    done = {"wall_s": wall, "cpu_s": cpu, "resumed": resume is not None}
    if cfg.model.autocast == "bfloat16":
        done["bf16_gemms"] = "fp32 on bf16-rounded operands" if emulates_bf16_gemms(plan.device) else "torch"
    mark_done(run_dir, done)
    return done


class RunFailed(RuntimeError):
    """A study run's child process failed; its own error went to stderr before this line."""


def _run_in_child(plan: StudyPlan, spec: RunSpec, study_dir: Path, threads: int) -> None:
    """One run in a fresh spawned process: each run's colocated vLLM engine dies with it."""
    exitcode = run_in_child(run_one, plan, spec, study_dir, threads)
    if exitcode != 0:
        kept = resume_point(study_dir / spec.name)
        where = "its folder keeps the last checkpoint" if kept else "it wrote no checkpoint and will start over"
        raise RunFailed(
            f"run {spec.name} failed (exit code {exitcode}; its error is above); {where}: "
            f"bapo study --resume {study_dir}"
        )


def prepare(plan: StudyPlan, study_dir: Path) -> None:
    """The study folder's plan and task split (written once; a resume keeps them)."""
    study_dir.mkdir(parents=True, exist_ok=True)
    train_rows, heldout = make_split(plan.task)
    if not (study_dir / "data" / "heldout.jsonl").exists():
        write_jsonl(train_rows, study_dir / "data" / "train.jsonl")
        write_jsonl(heldout, study_dir / "data" / "heldout.jsonl")
    info = study_dir / "study.json"
    if not info.exists():
        info.write_text(json.dumps({"plan": plan.to_json(), "runs": {}}, indent=2))


def load_plan(study_dir: Path) -> StudyPlan:
    info = Path(study_dir) / "study.json"
    if not info.exists():
        raise FileNotFoundError(f"--resume {study_dir}: no study.json there (not a bapo study folder)")
    return StudyPlan.from_json(json.loads(info.read_text())["plan"])


def run_study(
    plan: StudyPlan,
    study_dir: Path,
    threads: int = 2,
    in_process: bool = False,
    log=print,
    max_runs: int | None = None,
    reuse: tuple[Path, ...] = (),
) -> Path:
    """Train every unfinished run of `plan` into study_dir (finished ones are skipped), and
    rewrite the report after each. in_process: runs in this process (the tests' tiny model);
    else each run in a spawned process. max_runs: stop after this many runs finish in this sitting
    (one sitting per study in turn, e.g. two learning rates' studies a seed at a time). reuse:
    study folders whose finished runs this plan would train alike are copied first (reuse_runs)."""
    from bapo.train.rundir import RunLock

    study_dir = Path(study_dir)
    prepare(plan, study_dir)
    lock = RunLock(study_dir)  # one study process per folder (a second --resume fails in one line)
    try:
        if reuse and reuse_runs(plan, study_dir, list(reuse), log):
            write_study_report(plan, study_dir)
        _train_todo(plan, study_dir, threads, in_process, log, max_runs)
    finally:
        lock.release()
    return study_dir


def _train_todo(
    plan: StudyPlan, study_dir: Path, threads: int, in_process: bool, log, max_runs: int | None = None
) -> None:
    specs = plan.runs()
    todo = [spec for spec in specs if not is_done(study_dir / spec.name)]
    log(f"study {study_dir}: {len(specs) - len(todo)} of {len(specs)} runs done, {len(todo)} to go")
    if max_runs is not None and len(todo) > max_runs:
        log(f"this sitting trains {max_runs} of them (--max-runs); continue with bapo study --resume {study_dir}")
        todo = todo[:max_runs]
    for index, spec in enumerate(todo, 1):
        started = time.time()
        log(f"[{index}/{len(todo)}] {spec.name} ...")
        if in_process:
            run_one(plan, spec, study_dir, threads)
        else:
            _run_in_child(plan, spec, study_dir, threads)
        done = json.loads((study_dir / spec.name / "done.json").read_text())
        _record(study_dir, spec, done)
        log(f"[{index}/{len(todo)}] {spec.name} done in {time.time() - started:.0f} s")
        write_study_report(plan, study_dir)
    if not todo:
        write_study_report(plan, study_dir)


def _record(study_dir: Path, spec: RunSpec, done: dict) -> None:
    info_path = study_dir / "study.json"
    info = json.loads(info_path.read_text())
    info["runs"][spec.name] = done
    write_json(info_path, info)


# plan fields a run depends on outside its bapo.train config (the held-out hook's)
HOOK_FIELDS = ("eval_every", "eval_prompts", "eval_k_during", "final_k")
# config fields that name where a run lives, not what it trains
RUN_PLACE_FIELDS = (("run", "output_dir"), ("run", "overwrite"), ("data", "path"))


def _config_difference(ours: dict, theirs: dict) -> str | None:
    """The first `section.key` of `ours` (a bapo.train config as JSON) that `theirs` holds with
    another value, RUN_PLACE_FIELDS aside; keys `theirs` lacks (a config written before them) are
    skipped."""
    for section, values in ours.items():
        for key, value in values.items() if isinstance(values, dict) else ():
            if (section, key) in RUN_PLACE_FIELDS or key not in theirs.get(section, {}):
                continue
            if theirs[section][key] != value:
                fix = "; reuse needs the same model folder" if (section, key) == ("model", "path") else ""
                return f"{section}.{key} {theirs[section][key]!r} (this plan: {value!r}){fix}"
    return None


def _plan_difference(plan: StudyPlan, study_dir: Path, source_plan: StudyPlan, source: Path) -> str | None:
    """What makes every run of `source` another run than this plan's (None when nothing): a
    held-out setting or the task split."""
    for name in HOOK_FIELDS:
        if getattr(plan, name) != getattr(source_plan, name):
            return f"{name} {getattr(source_plan, name)} (this plan: {getattr(plan, name)})"
    for split in ("train.jsonl", "heldout.jsonl"):
        if (source / "data" / split).read_bytes() != (study_dir / "data" / split).read_bytes():
            return f"its task split (data/{split})"
    return None


def _run_difference(
    plan: StudyPlan, spec: RunSpec, study_dir: Path, source_plan: StudyPlan, source: Path
) -> str | None:
    """What makes source's finished run of `spec` another run than the one this plan trains (None
    when nothing): its bapo.train config, as this code makes it from both plans and as the run
    saved it (config.yaml: defaults of the code that trained it)."""
    import yaml

    def config_of(run_plan: StudyPlan, folder: Path) -> dict:
        return train_config(run_plan, spec, model_path(run_plan), folder, folder / spec.name).model_dump(mode="json")

    ours = config_of(plan, study_dir)
    saved = yaml.safe_load((source / spec.name / "config.yaml").read_text())
    return _config_difference(ours, config_of(source_plan, source)) or _config_difference(ours, saved)


def reuse_runs(plan: StudyPlan, study_dir: Path, sources: list[Path], log=print) -> list[str]:
    """Copy into study_dir every finished run of the `sources` study folders that this plan would
    train and has not: the same cell and seed, the same bapo.train config, held-out settings and
    task split (e.g. the regime gate's grpo runs into the plan that follows it). Each copy is
    recorded in study.json with `reused_from`; a source or run that differs is named, with the
    first field that differs, and left alone. Returns the names copied."""
    import shutil

    copied = []
    for source in sources:
        source_plan = load_plan(source)
        wanted = [spec for spec in plan.runs() if is_done(source / spec.name) and not is_done(study_dir / spec.name)]
        problem = _plan_difference(plan, study_dir, source_plan, source) if wanted else None
        if problem:
            log(f"not reused: the {len(wanted)} finished runs of {source} this plan has: they differ in {problem}")
            continue
        for spec in wanted:
            origin, target = source / spec.name, study_dir / spec.name
            problem = _run_difference(plan, spec, study_dir, source_plan, source)
            if problem:
                log(f"not reused: {origin} differs in {problem}")
                continue
            # copied whole under another name, then renamed: a kill never leaves a done.json
            # without the rest; a started, unfinished run of this study is replaced
            partial = target.with_name(target.name + ".reusing")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(origin, partial)
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
            done = json.loads((target / "done.json").read_text())
            _record(study_dir, spec, {**done, "reused_from": str(origin)})
            copied.append(spec.name)
            log(f"reused {origin}")
    return copied


def finished_runs(plan: StudyPlan, study_dir: Path) -> list[Path]:
    return [study_dir / spec.name for spec in plan.runs() if is_done(study_dir / spec.name)]


def header(plan: StudyPlan, study_dir: Path) -> list[str]:
    """The report's setting lines: task, model, plan, cost, what is finished."""
    from bapo.analysis.runs import find_runs

    task = plan.task
    info = json.loads((study_dir / "study.json").read_text())
    done, total = len(finished_runs(plan, study_dir)), len(plan.runs())
    wall = [run["wall_s"] for run in info["runs"].values()]
    reused = [str(Path(run["reused_from"]).parent) for run in info["runs"].values() if "reused_from" in run]
    ops = ", ".join(task.ops)
    return [
        f"Task: 'What is a op b?' (op {ops}; a in {task.a_min}-{task.a_max}, b in {task.b_min}-{task.b_max}), "
        f"chat template, user turn ending {task.suffix!r}, system prompt "
        f"{task.system_prompt or 'the template default'!r}, correct when the reply's last integer is the "
        f"answer; {task.max_new_tokens}-token budget; {task.n_heldout} held-out questions never trained on.",
        f"Policy: {'SmolLM2-135M-Instruct (bapo smollm2)' if 'smollm2' in plan.model else plan.model}, "
        f"rollout backend {plan.backend}, device {plan.device}; trainer forwards "
        + ("under bf16 autocast (fp32 weights)." if plan.autocast == "bfloat16" else "in fp32."),
        f"RL: {plan.rollout_steps} rollout steps per run, {plan.prompts_per_batch} prompts x {plan.group_size} "
        f"samples at temperature {plan.temperature}, lr {plan.lr}"
        + (f", LoRA rank {plan.lora_rank} (alpha 32, every linear layer)" if plan.lora_rank is not None else "")
        + f"; methods {', '.join(plan.methods)}; staleness E "
        f"{', '.join(map(str, plan.staleness_e))}"
        + (f"; async delay {', '.join(map(str, plan.async_delays))}" if plan.async_delays else "")
        + (
            f"; partial rollout ({plan.segment_tokens} tokens per reply per rollout step) for "
            f"{', '.join(plan.partial_rollout_methods)}"
            if plan.partial_rollout_methods
            else ""
        )
        + f"; seeds {', '.join(map(str, plan.seeds))}; bapo target share {BAPO_TARGET}. At E=0 without delay every "
        "ratio is 1 and every method gives GRPO's gradient, so E=0 is one run (listed as grpo)"
        + (
            f", except {', '.join(own)}, which run their own."
            if (own := plan.on_policy_methods()[1:] if plan.on_policy_shared else ())
            else "."
        ),
        f"Held-out: avg@{plan.eval_k_during} / pass@{plan.eval_k_during} on {plan.eval_prompts} questions every "
        f"{plan.eval_every} rollout steps, avg@{plan.final_k} / pass@{plan.final_k} on all at the end.",
        f"Runs finished: {done} of {total}"
        + (" (PARTIAL study)" if done < total else "")
        + (f", {len(reused)} of them reused from {', '.join(sorted(set(reused)))}" if reused else "")
        + (f"; wall time per run {min(wall):.0f}-{max(wall):.0f} s, {sum(wall):.0f} s summed" if wall else "")
        + (" (the reused runs' in their own study)." if reused and wall else "."),
        *step_time_lines(find_runs(finished_runs(plan, study_dir))),
    ]


def step_time_lines(runs) -> list[str]:
    """One line: the median rollout step of these runs and its parts (bapo.analysis.runs'
    rollout_step_times: each step counted once, its optimizer updates summed), with the vLLM weight
    push's share of the step (issue 36's <= 5%)."""
    from bapo.analysis.runs import step_time_summary

    times = step_time_summary([step for run in runs for step in run.rollout_step_times()])
    if "step_s" not in times:
        return []
    inside = []  # the rollout's parts
    if "sample_s" in times:
        inside.append(f"vLLM sampling {times['sample_s']:.1f} s")
    if "push_share" in times:
        inside.append(
            f"weight push {times['push_s']:.2f} s = {times['push_share']:.1%} of a rollout step, "
            f"at most {times['push_share_max']:.1%}"
        )
    parts = []
    if "rollout_s" in times:
        parts.append(f"rollout {times['rollout_s']:.1f} s" + (f" ({'; '.join(inside)})" if inside else ""))
    if "update_s" in times:
        parts.append(f"optimizer updates {times['update_s']:.1f} s")
    line = f"Time per rollout step (medians over every rollout step of the finished runs): {times['step_s']:.1f} s"
    return [line + (": " + ", ".join(parts) if parts else "") + "."]


def write_study_report(plan: StudyPlan, study_dir: Path, record_headline: bool = True) -> Path | None:
    """report.md, claims.json and plots/ from the finished runs (None when none has finished);
    record_headline: also keep the headline in study.json (off for `--report` beside a running
    study, which owns study.json)."""
    from bapo.analysis.claims import claims_json
    from bapo.analysis.plots import FIGURES, plot_runs
    from bapo.analysis.report import headline, write_report

    if not finished_runs(plan, study_dir):
        return None
    runs, claims = _runs_and_claims(plan, study_dir)
    figures = {**FIGURES, **STUDY_FIGURES}
    plots = plot_runs(runs, study_dir / "plots", target_share=BAPO_TARGET, figures=figures)
    report = write_report(
        study_dir / "report.md",
        runs,
        claims,
        plots,
        BAPO_TARGET,
        header(plan, study_dir),
        title="bapo study report",
        model_label="SmolLM2-135M-Instruct",
        columns=STUDY_COLUMNS,
        notes=column_notes(plan),
    )
    (study_dir / "claims.json").write_text(claims_json(claims) + "\n")
    if record_headline:
        info_path = study_dir / "study.json"
        info = json.loads(info_path.read_text())
        info["headline"] = headline(claims, model_label="SmolLM2-135M-Instruct")
        write_json(info_path, info)
    return report


def _columns():
    from bapo.analysis.report import RUN_COLUMNS

    return {
        **RUN_COLUMNS,
        "entropy digits": lambda r: r.tail_mean("entropy/digit"),
        "entropy other": lambda r: r.tail_mean("entropy/other"),
        "response tokens": lambda r: r.tail_mean("response_length/mean"),
        "logp gap": lambda r: r.mean("rollout/logp_diff/mean"),
        "premise pos clipped low": lambda r: r.mean("premise/pos_clipped_low_share"),
        "premise pos kept low": lambda r: r.mean("premise/pos_kept_low_share"),
        "premise neg clipped low": lambda r: r.mean("premise/neg_clipped_low_share"),
        "premise neg kept low": lambda r: r.mean("premise/neg_kept_low_share"),
    }


TABLES_START, TABLES_END = (
    "<!-- STUDY_TABLES:START (bapo study --resume DIR --report --results FILE) -->",
    ("<!-- STUDY_TABLES:END -->"),
)


def study_tables(plan: StudyPlan, study_dir: Path, command: str) -> str:
    """The block docs/RESULTS.md quotes: the setting, the headline, the claims table, the per-run
    table and what the updates did, from the finished runs (the same code as report.md)."""
    from bapo.analysis.claims import claims_markdown
    from bapo.analysis.mechanics import mechanics_section
    from bapo.analysis.report import headline, markdown_table, start_row, summary

    runs, claims = _runs_and_claims(plan, study_dir)
    lines = [TABLES_START, f"Run: `{command}`.", "", *[f"- {line}" for line in header(plan, study_dir)], ""]
    lines += [f"- {line}" for line in headline(claims, model_label="SmolLM2-135M-Instruct")]
    lines += ["", claims_markdown(claims), "", markdown_table(summary(runs, STUDY_COLUMNS), start_row(runs))]
    lines += ["", column_notes(plan), "", *mechanics_section(runs)]
    return "\n".join([*lines, TABLES_END])


def column_notes(plan: StudyPlan) -> str:
    """The demo's notes under the per-run table, at the study's temperature, plus its own columns."""
    from bapo.analysis.report import COLUMN_NOTES

    return (
        COLUMN_NOTES.replace("at temperature 1;", f"at temperature {plan.temperature};")
        + " entropy digits / other: the entropy of the tokens that hold a digit / of the others (last 20%"
        " of updates); response tokens: last 20%; logp gap: mean |trainer - engine| log-prob over all"
        " updates; premise pos / neg clipped / kept low: share of low-probability tokens (log pi < -H of"
        " their state) among the positive / negative tokens the clip removed / kept (premise/*), mean"
        " over all updates: the Entropy-Clip Rule's premise is clipped > kept for positive tokens; the"
        " start policy row is"
        " SmolLM2-135M-Instruct itself (labelled sft)."
    )


def _runs_and_claims(plan: StudyPlan, study_dir: Path):
    from bapo.analysis.run_claims import run_claims
    from bapo.analysis.runs import find_runs

    runs = find_runs(finished_runs(plan, study_dir))
    claims = run_claims(
        runs,
        BAPO_TARGET,
        treatments=("bapo", "bapo-paper"),
        where="SmolLM2-135M, arithmetic",
        token_kinds=True,
        peers=PEERS,
    )
    return runs, claims


# the per-run table's columns: the demo's, then entropy by token kind, length, the logp gap, the premise
STUDY_COLUMNS = _columns()
# the study's extra figures: entropy by token kind, the engine-vs-trainer gap, response length
STUDY_FIGURES = {
    "entropy_by_kind": (
        "entropy by token kind: digits (solid), other tokens (dashed)",
        [("entropy/digit", "-"), ("entropy/other", "--")],
    ),
    "heldout_pass": ("held-out pass@k during training", [("heldout/pass", "-")]),
    "response_length": ("response length (tokens)", [("response_length/mean", "-")]),
    "logp_gap": ("engine-vs-trainer log-prob gap (mean |diff|)", [("rollout/logp_diff/mean", "-")]),
}


# what the folders of one gate share: the cells (staleness, delays), seeds and methods may differ
GATE_SAME = ("task", "temperature", "lr", "lora_rank", "rollout_steps", "prompts_per_batch", "group_size", "autocast")


def gate_lines(study_dirs: list[Path]) -> list[str]:
    """The regime gate (bapo.analysis.regime) over the finished grpo runs of these study folders
    (e.g. the on-policy study at the chosen lr and the stale one), with each folder's lr. ValueError
    when the folders' plans differ in a GATE_SAME field."""
    from bapo.analysis.regime import gate_section
    from bapo.analysis.runs import find_runs

    runs, sources = [], []
    plans = [load_plan(study_dir) for study_dir in study_dirs]
    for field_name in GATE_SAME:  # runs are pooled by setting: one plan's runs only, whatever their cells
        values = [getattr(plan, field_name) for plan in plans]
        if any(value != values[0] for value in values):
            named = ", ".join(
                f"{study_dir} ({field_name} {task_spec(value) if field_name == 'task' else value})"
                for study_dir, value in zip(study_dirs, values, strict=True)
            )
            raise ValueError(f"--gate {named}: different plans (their runs would be pooled): gate them separately")
    for study_dir, plan in zip(study_dirs, plans, strict=True):
        finished = finished_runs(plan, study_dir)
        runs += find_runs(finished) if finished else []  # a folder whose first run is still training
        lora = f", LoRA rank {plan.lora_rank}" if plan.lora_rank is not None else ""
        sources.append(f"{study_dir} (task {task_spec(plan.task)}, temperature {plan.temperature}, lr {plan.lr}{lora})")
    return [f"Runs from: {'; '.join(sources)}.", "", *gate_section(runs, BAPO_TARGET)]


def plan_for(profile: str, **changes) -> StudyPlan:
    """A profile from PROFILES with some fields replaced (None values are ignored)."""
    return plan_from(PROFILES, profile, **changes)
