"""bapo.train.precision: bf16 autocast on a CPU without bf16 units runs its GEMMs as fp32 GEMMs of
bf16-rounded operands. Checked against torch.autocast's own bf16 GEMMs (whatever kernels this CPU
has: native, or the fallback) and against a float64 reference of the same rounded operands."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bapo.train.precision as precision
from bapo.train.precision import (
    Bf16GemmsInFp32,
    emulated_cpu_bf16_autocast,
    emulates_bf16_gemms,
    forward_autocast,
    native_bf16,
)

F = torch.nn.functional
BF16_STEP = 2.0**-7  # spacing of bf16 values in [1, 2): one step relative is <= 2^-7


def torch_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


ATEN_GEMMS = {"mm", "bmm", "addmm", "baddbmm", "addbmm"}


class GemmDtypes(TorchDispatchMode):
    """Records the operand dtypes of every aten GEMM that runs: values alone cannot tell the
    emulated path from torch's (they agree up to summation order), the kernels' dtypes can."""

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ATEN_GEMMS:
            self.seen |= {arg.dtype for arg in args if isinstance(arg, torch.Tensor)}
        return func(*args, **(kwargs or {}))


def rounded(x):
    return x.detach().to(torch.bfloat16).double()


def gemm_cases(gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    x, w, b = randn(24, 64).requires_grad_(), (randn(48, 64) / 8).requires_grad_(), randn(48).requires_grad_()
    a3, b3 = randn(3, 24, 32).requires_grad_(), randn(3, 32, 16).requires_grad_()
    a4, b4 = randn(2, 3, 24, 32).requires_grad_(), randn(2, 3, 32, 16).requires_grad_()
    return {
        "linear": (lambda: F.linear(x, w, b), lambda: rounded(x) @ rounded(w).T + rounded(b)),
        "matmul_4d": (lambda: torch.matmul(a4, b4), lambda: rounded(a4) @ rounded(b4)),
        "operator_matmul": (lambda: a3 @ b3, lambda: rounded(a3) @ rounded(b3)),
        "bmm": (lambda: torch.bmm(a3, b3), lambda: rounded(a3) @ rounded(b3)),
        "mm": (lambda: x.mm(w.T), lambda: rounded(x) @ rounded(w).T),
        "addmm": (lambda: torch.addmm(b, x, w.T), lambda: rounded(b) + rounded(x) @ rounded(w).T),
        "baddbmm": (
            lambda: torch.baddbmm(a3[..., :16], a3, b3),
            lambda: rounded(a3[..., :16]) + rounded(a3) @ rounded(b3),
        ),
    }


@pytest.mark.parametrize("case", ["linear", "matmul_4d", "operator_matmul", "bmm", "mm", "addmm", "baddbmm"])
def test_emulated_gemm_is_the_bf16_gemm_up_to_summation_order(case):
    compute, reference = gemm_cases(torch.Generator().manual_seed(0))[case]
    with torch_bf16():
        by_torch = compute()
    with emulated_cpu_bf16_autocast():
        emulated = compute()
    exact = reference()
    assert emulated.dtype == by_torch.dtype == torch.bfloat16
    # the exact product of the rounded operands, rounded once to bf16, is what a bf16 GEMM with fp32
    # accumulation returns; summation order can move an output that sits near a rounding midpoint
    # one bf16 step, so a few may differ, by one step at most
    step = exact.abs().clamp_min(1e-3) * BF16_STEP
    assert ((emulated.double() - exact).abs() <= step).all()
    assert (emulated.double() != exact.to(torch.bfloat16).double()).float().mean() < 0.01
    assert ((emulated.double() - by_torch.double()).abs() <= 2 * step).all()
    assert (emulated != by_torch).float().mean() < 0.01
    # an fp32 GEMM left unrounded would differ from the bf16 result almost everywhere
    assert (compute().double() != by_torch.double()).float().mean() > 0.5
    # and the kernels that ran were fp32 ones: forward and backward (which runs outside autocast,
    # as the trainer's does)
    with GemmDtypes() as kernels:
        with emulated_cpu_bf16_autocast():
            out = compute()
        out.float().sum().backward()
    assert kernels.seen == {torch.float32}
    with GemmDtypes() as kernels, torch_bf16():
        compute()
    assert kernels.seen == {torch.bfloat16}


def test_emulated_linear_gradients_are_the_bf16_ones():
    gen = torch.Generator().manual_seed(1)
    x0, w0, grad_out = (
        torch.randn(32, 64, generator=gen),
        torch.randn(48, 64, generator=gen) / 8,
        torch.randn(32, 48, generator=gen),
    )
    grads = {}
    for name, context in (("torch", torch_bf16), ("emulated", emulated_cpu_bf16_autocast)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with context():
            out = F.linear(x, w)
        (out.float() * grad_out).sum().backward()
        grads[name] = (x.grad, w.grad)
    for by_torch, emulated in zip(grads["torch"], grads["emulated"], strict=True):
        assert by_torch.dtype == emulated.dtype == torch.float32  # the fp32 leaves' grads
        # both are bf16 values (the backward GEMMs' outputs are rounded to bf16 before the cast to fp32)
        assert torch.equal(emulated, emulated.to(torch.bfloat16).float())
        assert (emulated != by_torch).float().mean() < 0.01
        step = by_torch.abs().clamp_min(1e-3) * BF16_STEP
        assert ((emulated - by_torch).abs() <= 2 * step).all()


def test_only_gemms_inside_autocast_are_rerouted():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with Bf16GemmsInFp32():  # no autocast: the op runs as called
        assert F.linear(x, w).dtype == torch.float32
    with emulated_cpu_bf16_autocast():
        with torch.autocast("cpu", enabled=False):  # e.g. the rotary embedding's fp32 region
            assert torch.equal(F.linear(x, w), x @ w.T)
        with torch.autocast("cpu", dtype=torch.float16):  # another autocast dtype: autocast's
            assert F.linear(x, w).dtype == torch.float16
        assert F.linear(x, w).dtype == torch.bfloat16
        assert F.softmax(x, -1).dtype == torch.float32  # not a GEMM: autocast's own rule
        assert torch.equal(x.double() @ w.double().T, torch.matmul(x.double(), w.double().T))  # float64 untouched
        out = torch.empty(4, 6)  # out= variants are not autocast's: they run as called
        assert torch.mm(x, w.T, out=out) is out  # written in fp32 (bf16 would be ~4e-3 off)
        torch.testing.assert_close(out, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_forward_autocast_emulates_only_where_the_cpu_lacks_bf16(monkeypatch, native):
    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    assert emulates_bf16_gemms("cpu") == (not native)
    assert not emulates_bf16_gemms("cuda:0") and not emulates_bf16_gemms("meta")  # CPUs only
    model = torch.nn.Linear(8, 4)
    assert isinstance(forward_autocast(model, "none"), contextlib.nullcontext)
    context = forward_autocast(model, "bfloat16")
    assert isinstance(context, torch.autocast) == native
    with context:
        assert model(torch.randn(2, 8)).dtype == torch.bfloat16


def test_native_bf16_reads_any_device_string():
    assert native_bf16("cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert native_bf16("auto") == native_bf16("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert not native_bf16("cuda:0")
