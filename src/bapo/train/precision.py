"""The trainer's precision context (model.autocast): `forward_autocast`.

"bfloat16" is torch.autocast to bf16 on the model's device type. A CPU without bf16 units (AVX2
only, no AVX512-BF16 / AMX) runs torch's bf16 GEMMs through a slow fallback (a SmolLM2 update ~10x
its fp32 time, bench/README.md). There the GEMMs that an HF decoder's forward and backward reach
(linear, matmul / @, mm, bmm, addmm, baddbmm, addbmm) run instead as fp32 GEMMs of bf16-rounded
operands, their output rounded to bf16. A bf16 GEMM multiplies bf16 operands exactly and
accumulates in fp32, so this is the same computation up to summation order (~1e-4 of the outputs
land one bf16 step apart, more with longer sums), and the backward's gradients come out
bf16-rounded as torch's do (tests/train/test_precision.py). Every other op keeps torch.autocast's
rule: attention (bf16 SDPA) stays torch's, so does its rounding, and what autocast lists but a
decoder does not call from Python (einsum, tensordot, convolutions) takes torch's kernels, right but
slow. Memory: each GEMM keeps fp32 copies of its rounded operands for backward where torch keeps
bf16 ones (twice the GEMM inputs' share of activation memory, and an fp32 copy of the weights per
live graph: ~0.5 GB for SmolLM2-135M).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

F = torch.nn.functional

# the GEMMs in torch.autocast's bf16 list on CPU that a transformer forward reaches from Python
_GEMMS = frozenset(
    {
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.Tensor.addmm,
        torch.baddbmm,
        torch.Tensor.baddbmm,
        torch.addbmm,
        torch.Tensor.addbmm,
    }
)


def device_type(device: str) -> str:
    """The torch device type of a model.device value ("auto": cuda when available, else cpu)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


@functools.cache
def _native_bf16(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True


def native_bf16(device: str) -> bool:
    """Whether `device` (cpu, cuda, cuda:0, auto) computes bf16 GEMMs natively: CUDA with bf16, or a
    CPU whose oneDNN has bf16 kernels (AVX512-BF16 / AMX). Other device types count as native."""
    return _native_bf16(device_type(device))


def emulates_bf16_gemms(device: str) -> bool:
    """Whether bf16 autocast on `device` runs its GEMMs in fp32 (Bf16GemmsInFp32): a CPU without
    bf16 units. The one decision forward_autocast and the study's records both read."""
    return device_type(device) == "cpu" and not native_bf16("cpu")


def _bf16_rounded_fp32(value):
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float32, torch.bfloat16):
        return value.to(torch.bfloat16).to(torch.float32)
    return value


def _tensors(tree) -> list[torch.Tensor]:
    return [value for value in tree_leaves(tree) if isinstance(value, torch.Tensor)]


def _to_bf16(value):
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return value.to(torch.bfloat16)
    return value


class Bf16GemmsInFp32(TorchFunctionMode):
    """Inside CPU bf16 autocast: each GEMM of _GEMMS as an fp32 GEMM of bf16-rounded operands,
    its output cast to bf16 (module docstring). Outside autocast (e.g. a region that turns it
    off, as the rotary embedding's does) the op runs as called."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (
            func in _GEMMS
            and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and "out" not in kwargs  # out= variants are not autocast's either: they run as called
            and all(value.device.type == "cpu" for value in _tensors((args, kwargs)))
        ):
            return func(*args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            out = func(*tree_map(_bf16_rounded_fp32, args), **tree_map(_bf16_rounded_fp32, kwargs))
        return tree_map(_to_bf16, out)


@contextlib.contextmanager
def emulated_cpu_bf16_autocast():
    """CPU bf16 autocast with its GEMMs on fp32 kernels (Bf16GemmsInFp32)."""
    with torch.autocast("cpu", dtype=torch.bfloat16), Bf16GemmsInFp32():
        yield


def forward_autocast(model, autocast: str):
    """The precision context of the trainer's forwards (model.autocast): no context for "none";
    for "bfloat16", torch.autocast to bf16 on the model's device type, with the GEMMs emulated in
    fp32 on a CPU without bf16 units (module docstring)."""
    if autocast == "none":
        return contextlib.nullcontext()
    device = next(model.parameters()).device
    if emulates_bf16_gemms(str(device)):
        return emulated_cpu_bf16_autocast()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def checkpointing_kwargs(model, autocast: str) -> dict | None:
    """gradient_checkpointing_kwargs for the model's gradient_checkpointing_enable (None: its
    defaults). Where the forwards run Bf16GemmsInFp32, the backward's recompute must too: torch's
    non-reentrant checkpoint restores autocast there but not a TorchFunctionMode, so it would
    recompute with torch's bf16 GEMMs and find bf16 tensors where the forward saved fp32 ones."""
    if autocast == "none" or not emulates_bf16_gemms(str(next(model.parameters()).device)):
        return None
    return {"use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), Bf16GemmsInFp32())}
