"""The one typed training config: pydantic sections, YAML + `a.b=value` overrides.

Every check happens here, before any model or data is loaded: an unknown key fails with the
nearest valid name, a bad value names the field and what would fix it.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from bapo.core import BAPOConfig


class ConfigError(ValueError):
    """A config that cannot run; the message says which field and how to fix it."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    path: str = Field(..., description="local directory or Hugging Face id, loaded with from_pretrained")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


class DataSection(Section):
    path: Optional[str] = None  # JSONL / JSON / Parquet; None when examples are passed to train()
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    chat_template: bool = False  # wrap the prompt as one user turn with the tokenizer's template
    system_prompt: Optional[str] = None
    max_prompt_tokens: int = Field(256, gt=0)  # longer prompts are dropped (and counted)
    shuffle: bool = True


class RolloutSection(Section):
    backend: Literal["hf", "vllm"] = "hf"
    # hf backend's sampling loop: lean = bapo's KV-cache loop (same draws as generate, faster, and
    # the behaviour log-probs come from it in fp32), hf = model.generate, auto = lean when the model supports it
    sampler: Literal["auto", "lean", "hf"] = "auto"
    prompts_per_batch: int = Field(8, gt=0)
    group_size: int = Field(4, gt=0)  # G responses per prompt
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 = off
    stop: list[str] = []
    segment_tokens: Optional[int] = Field(None, gt=0)  # partial rollout: at most L new tokens per step
    logprob_batch_size: int = Field(64, gt=0)  # rows per no-grad forward when recomputing log-probs


class RewardSection(Section):
    verifier: str = "exact"  # "exact" | "math" | "format" | "package.module:attr"
    format_pattern: str = r"\\boxed\{.+?\}"  # regex for the "format" verifier (re.search)
    timeout_s: float = Field(5.0, gt=0)
    correct_threshold: float = 1.0  # accuracy = share of responses with reward >= this


# The fields of bapo.core.BAPOConfig (Algorithm 1's search space), derived so that the two never
# drift apart; BAPOConfig's own checks run on them in TrainConfig._check_loss_params.
BAPOSection = create_model(
    "BAPOSection",
    __base__=Section,
    **{f.name: (type(f.default), f.default) for f in dataclass_fields(BAPOConfig)},
)


class LossSection(Section):
    method: str = "grpo"
    agg_mode: str = "token-mean"
    params: dict[str, Any] = {}  # extra keyword arguments for policy_loss (lower=, upper=, dual_clip=, ...)
    # Cap on the ratio of negative-advantage tokens (verl's clip_ratio_c) for every loss that takes
    # one (grpo, clip-higher, bapo, dcpo); null = each loss's own default (off, except `dual-clip`).
    dual_clip: Optional[float] = Field(3.0, gt=1.0)
    bapo: BAPOSection = BAPOSection()
    scale_by_std: bool = True  # False = Dr.GRPO advantages (no division by the group std)
    zero_variance: Literal["keep", "drop"] = "keep"  # drop = dynamic sampling (no refill)
    kl_coef: float = Field(0.0, ge=0)  # k3 KL to the initial model; > 0 keeps a frozen copy
    entropy_coef: float = Field(0.0, ge=0)


class OffPolicySection(Section):
    staleness: int = Field(0, ge=0)  # k: update t trains on the batch generated at rollout step t-k
    mode: Literal["fifo", "replay"] = "fifo"
    replay_batches: int = Field(4, gt=0)  # replay: how many recent batches are mixed
    mini_batches: int = Field(1, gt=0)  # optimizer updates per epoch over one rollout batch
    epochs: int = Field(1, gt=0)


class OptimSection(Section):
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_updates: int = Field(0, ge=0)
    max_grad_norm: Optional[float] = Field(1.0, gt=0)  # None = no clipping (norm still logged)
    micro_batch_size: int = Field(32, gt=0)  # sequences per forward+backward


class DivergenceSection(Section):
    """When to stop a run that has diverged (a checkpoint is written first); see bapo.train.trainer."""
    entropy_fraction: float = Field(0.95, gt=0, le=1)  # mean token entropy >= this x log(vocab): near uniform
    max_abs_weight: float = Field(1e4, gt=0)  # any parameter with |value| above this
    zero_variance_steps: int = Field(20, ge=0)  # rollout steps in a row where every group had zero variance; 0 = off


class RunSection(Section):
    output_dir: str = "runs/bapo"  # the run directory itself (metrics.jsonl, checkpoints/, config.yaml)
    overwrite: bool = False  # allow starting afresh in a directory that already holds a run
    steps: int = Field(100, gt=0)  # rollout steps; optimizer updates = steps * mini_batches * epochs
    seed: int = 0
    checkpoint_every: int = Field(50, ge=0)  # rollout steps; 0 = only at the end
    keep_checkpoints: int = Field(2, gt=0)
    save_optimizer: Literal["latest", "all", "none"] = "latest"  # optimizer state in which checkpoints
    divergence: DivergenceSection = DivergenceSection()
    max_nonfinite: int = Field(3, gt=0)  # stop after this many skipped (non-finite) updates in a row
    tensorboard: Literal["auto", "on", "off"] = "auto"
    progress: bool = True
    deterministic: bool = False  # torch.use_deterministic_algorithms (CUDA needs it for exact resume)


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
    def _check(self) -> "TrainConfig":
        from bapo.core import LOSS_AGG_MODES as AGG_MODES, POLICY_LOSSES

        if self.loss.method not in POLICY_LOSSES:
            raise ValueError(f"loss.method={self.loss.method!r}: choose one of {', '.join(POLICY_LOSSES)}"
                             + _suggest(self.loss.method, POLICY_LOSSES))
        if self.loss.agg_mode not in AGG_MODES:
            raise ValueError(f"loss.agg_mode={self.loss.agg_mode!r}: choose one of {', '.join(AGG_MODES)}"
                             + _suggest(self.loss.agg_mode, AGG_MODES))
        rows = self.rollout.prompts_per_batch * self.rollout.group_size
        if rows % self.offpolicy.mini_batches:
            raise ValueError(f"offpolicy.mini_batches={self.offpolicy.mini_batches} must divide the "
                             f"rollout batch of {rows} responses (rollout.prompts_per_batch x rollout.group_size)")
        if self.offpolicy.mode == "replay" and self.offpolicy.staleness:
            raise ValueError("offpolicy.staleness applies to mode=fifo; replay mixes the last "
                             "offpolicy.replay_batches batches (set offpolicy.staleness=0)")
        if self.rollout.group_size == 1:
            raise ValueError("rollout.group_size=1 gives zero group advantages: use 2 or more")
        self._check_loss_params()
        if self.data.path is not None and not Path(self.data.path).suffix.lower() in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"data.path={self.data.path!r}: use a .jsonl, .json or .parquet file")
        if not math.isfinite(self.optim.lr):
            raise ValueError("optim.lr must be finite")
        return self

    def _check_loss_params(self) -> None:
        """Method parameters and the BAPO search space, checked by bapo.core's own rules."""
        import inspect

        from bapo.core import POLICY_LOSSES

        try:
            BAPOConfig(**self.loss.bapo.model_dump())
        except ValueError as err:
            raise ValueError(f"loss.bapo.{err}") from None
        accepted = [n for n, p in inspect.signature(POLICY_LOSSES[self.loss.method]).parameters.items()
                    if p.kind is p.KEYWORD_ONLY and n not in ("bapo", "bounds")]
        for name in self.loss.params:
            if name not in accepted:
                raise ValueError(f"loss.params.{name}: not a parameter of loss.method={self.loss.method!r}; "
                                 f"it takes {accepted}" + _suggest(name, accepted))

    @property
    def updates_per_batch(self) -> int:
        return self.offpolicy.mini_batches * self.offpolicy.epochs

    @property
    def total_updates(self) -> int:
        return self.run.steps * self.updates_per_batch

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(data: dict, model: type[BaseModel], prefix: str = "") -> None:
    """Unknown keys fail with the nearest valid dotted name (before pydantic's own message)."""
    for key, value in data.items():
        fields = model.model_fields
        if key not in fields:
            options = [prefix + name for name in fields]
            raise ConfigError(f"unknown config key {prefix + key!r}" + _suggest(prefix + key, options)
                              + f"; valid keys here: {', '.join(options)}")
        sub = fields[key].annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, Section):
            _check_keys(value, sub, prefix + key + ".")


def apply_override(data: dict, item: str) -> None:
    """`a.b=value` (value parsed as YAML: numbers, bools, lists) into the nested dict."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value (e.g. loss.method=bapo)")
    key, _, raw = item.partition("=")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None


def config_from_dict(data: dict, overrides: list[str] = ()) -> TrainConfig:
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy with plain types
    for item in overrides:
        apply_override(data, item)
    _check_keys(data, TrainConfig)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "config"
            got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(msg if where == "config" else f"{where}: {msg}{got}")
        raise ConfigError("bad config:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """YAML file (or None for an empty base) + `a.b=value` overrides -> a validated TrainConfig."""
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return config_from_dict(data, overrides)
