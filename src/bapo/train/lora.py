"""LoRA updates (model.lora): peft adapters injected into the trainer's Hugging Face model.

The trainer keeps the Hugging Face causal LM itself as its policy (`Trainer.model`): peft injects
its LoRA layers into that object in place, so the policy's forward (rollout samplers, log-prob
recomputes, the update) is the adapted model and every caller that takes an HF model keeps working.
The `PeftModel` around it (`Trainer.lora`) is only used for what peft owns: the adapter's
parameters, `disable_adapter()` (the KL reference is the base, not a second copy) and its
adapter-only save format.

`merged_weights` gives the adapted model's weights under the base model's own parameter names,
W + scale * B @ A computed into new tensors (the trained model is never merged in place, so its
unmerged forward and exact resume are untouched): the vLLM push and the checkpoint's `model/`
folder (what `bapo eval` and any HF tool load).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

ADAPTER_DIR = "adapter"  # checkpoint sub-folder: peft's adapter_config.json + adapter_model.safetensors


def is_lora_model(model) -> bool:
    """Whether peft injected adapter layers into `model` (peft sets `peft_config` on it)."""
    return bool(getattr(model, "peft_config", None))


def add_lora(model, section, seed: int):
    """Inject LoRA adapters (model.lora: rank, alpha, target_modules, dropout) into `model` in place;
    the base weights are frozen. Returns the PeftModel around it. The adapters' random init
    (peft: A Kaiming-uniform, B zero, so the adapted model starts equal to the base) is drawn from
    `seed` in a forked RNG: the same run seed gives the same init, and the run's RNG is untouched."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=section.rank,
        lora_alpha=section.alpha,
        target_modules=section.target_modules,
        lora_dropout=section.dropout,
        bias="none",
    )
    devices = [next(model.parameters()).device] if next(model.parameters()).is_cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, config)
        except ValueError as err:  # peft: "Target modules {...} not found in the base model ..."
            from bapo.train.config import ConfigError

            first = str(err).strip().splitlines()[0]
            raise ConfigError(
                f"model.lora.target_modules={section.target_modules!r}: {first}; use all-linear or names of "
                f"{type(model).__name__}'s linear layers (e.g. [q_proj, v_proj])"
            ) from None


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


@torch.no_grad()
def merged_weights(model) -> dict[str, torch.Tensor]:
    """The weights `model` computes with, under the base model's parameter names: for a model
    with LoRA layers each adapted weight is W + sum over active adapters of scale * B @ A
    (peft's `get_delta_weight`, new tensors; `model` is not changed) and the adapters' own
    parameters are left out; for a plain model its state_dict, detached. Tensors that are not
    adapted are the model's own storage (tied embeddings stay tied)."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    if not is_lora_model(model):
        return state
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        prefixes = (name.rsplit(".", cut)[0] for cut in range(1, name.count(".") + 1))
        owner = next((prefix for prefix in prefixes if prefix in layers), None)  # the innermost LoRA layer
        if owner is None:
            out[name] = tensor
            continue
        rest = name[len(owner) + 1 :]
        if not rest.startswith("base_layer."):
            continue  # lora_A / lora_B / ...: folded into the base weight below
        layer = layers[owner]
        if layer.merged:
            raise RuntimeError(f"{owner}: adapters merged in place; merged_weights expects them apart")
        leaf = rest.removeprefix("base_layer.")
        if leaf == "weight" and not layer.disable_adapters:
            for adapter in layer.active_adapters:
                tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        out[f"{owner}.{leaf}"] = tensor
    return out


def save_adapter(peft_model, folder: Path) -> None:
    """The adapter alone (peft's format: adapter_config.json, adapter_model.safetensors)."""
    peft_model.save_pretrained(str(folder), safe_serialization=True)


def load_adapter(peft_model, folder: Path) -> None:
    """Load adapter weights written by `save_adapter` into `peft_model` (its adapters already
    injected with the same config); every adapter tensor must be found, none may be left over."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a LoRA run's checkpoint holds its adapter there)")
    weights = load_file(str(path), device=str(next(peft_model.parameters()).device))
    result = set_peft_model_state_dict(peft_model, weights)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [key for key in getattr(result, "missing_keys", []) or [] if "lora_" in key]
    if unexpected or missing:
        raise ValueError(
            f"{path}: does not match model.lora (unexpected {unexpected[:3]}, missing {missing[:3]}); "
            "it was written with another rank or target_modules"
        )


@contextmanager
def adapter_dropout(model):
    """The LoRA dropout modules in train mode for the update's gradient forward (the trainer
    runs its other forwards in eval mode, so dropout is off wherever log-probs are read); a
    no-op without LoRA or with dropout 0 (peft then uses Identity)."""
    dropouts = [
        module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Dropout) and ".lora_dropout." in f".{name}."
    ]
    modes = [module.training for module in dropouts]
    for module in dropouts:
        module.train(True)
    try:
        yield
    finally:
        for module, mode in zip(dropouts, modes):
            module.train(mode)
