"""The trainer's precision context (model.autocast): `forward_autocast`.

"bfloat16" is torch.autocast to bf16 on the model's device type. A CPU without bf16 units (AVX2
only, no AVX512-BF16 / AMX) runs a bf16 GEMM through a slow fallback: a SmolLM2 update took 110 s
there under torch.autocast, 22 s with this module and 11 s in fp32 (bench/README.md,
`bench/real_model.py --bf16-fallback`). There the GEMMs that autocast would run in bf16 (linear,
matmul, mm, bmm, addmm, baddbmm, addbmm) run instead as fp32 GEMMs of bf16-rounded operands, their
output rounded to bf16. A bf16 GEMM multiplies bf16 operands exactly and accumulates in fp32, so
this is the same computation up to summation order: a few outputs in 1e5 land one bf16 step apart,
and the backward's gradients come out bf16-rounded as torch's do (tests/train/test_precision.py).
Every other op keeps torch.autocast's rule, attention (bf16 SDPA) included, so its rounding stays
torch's; the fallback runs it at a tolerable cost.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

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


@functools.cache
def native_bf16(device_type: str) -> bool:
    """Whether `device_type` computes bf16 GEMMs natively: CUDA with bf16, or a CPU whose oneDNN has
    bf16 kernels (AVX512-BF16 / AMX). Other devices are left to torch.autocast."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True


def _bf16_rounded_fp32(value):
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float32, torch.bfloat16):
        return value.to(torch.bfloat16).to(torch.float32)
    return value


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
        if func not in _GEMMS or not torch.is_autocast_enabled("cpu"):
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
    device_type = next(model.parameters()).device.type
    if device_type == "cpu" and not native_bf16("cpu"):
        return emulated_cpu_bf16_autocast()
    return torch.autocast(device_type, dtype=torch.bfloat16)
