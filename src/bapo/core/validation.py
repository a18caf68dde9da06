"""Input checks shared by the losses, the bound search and the diagnostics.

All checks of one call are reduced on the device and read back in a single host sync, so a
valid batch costs one `.tolist()`; the slow path that locates a bad value runs only on error.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_token_inputs(
    named: dict[str, Tensor],
    mask: Tensor,
    *,
    reference: str,
    allow_row_vector: tuple[str, ...] = (),
    extra_checks: tuple = (),
) -> None:
    """Raise ValueError naming the argument when shapes, dtypes, non-finite values or the mask are wrong.

    named: float tensors that must have the reference tensor's [B, T] shape (those listed in
    allow_row_vector may also be [B]). mask: [B, T] of 0/1 (bool or numeric). NaN or +-inf is an
    error at masked-in positions (for a [B] tensor: rows with a masked-in token) and allowed elsewhere.
    extra_checks: callables of the named tensors giving (0-dim bool "is bad", error message),
    folded into the same sync.
    """
    shape = tuple(named[reference].shape)
    if len(shape) != 2:
        raise ValueError(f"{reference}: expected shape [batch, response_len], got {shape}")
    for name, tensor in named.items():
        if not isinstance(tensor, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {tensor.dtype}; cast with .float()")
        ok_shapes = [shape] + ([shape[:1]] if name in allow_row_vector else [])
        if tuple(tensor.shape) not in ok_shapes:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not match {reference}'s {shape}; "
                f"pass every per-token tensor as [batch, response_len]"
            )
    if not isinstance(mask, Tensor) or tuple(mask.shape) != shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask: expected a tensor of shape {shape}, got {got}")

    # One device-side reduction for every check, then a single sync. Positions outside the mask
    # are padding: they may hold anything (-inf log-probs of padded tokens) and are never read.
    counted = mask != 0
    counted_rows = counted.any(-1)
    checks = [
        ((~torch.isfinite(tensor) & (counted if tensor.dim() == 2 else counted_rows)).any(), name)
        for name, tensor in named.items()
    ]
    if mask.dtype != torch.bool:
        checks.append((((mask != 0) & (mask != 1)).any(), "mask"))
    checks += [(check(named), message) for check, message in extra_checks]
    bad = torch.stack([flag for flag, _ in checks]).tolist()
    for (_, what), is_bad in zip(checks, bad):
        if not is_bad:
            continue
        if what in named:
            tensor = named[what]
            under_mask = tensor[counted if tensor.dim() == 2 else counted_rows]
            nan, inf = int(torch.isnan(under_mask).sum()), int(torch.isinf(under_mask).sum())
            raise ValueError(
                f"{what}: contains {nan} NaN and {inf} inf value(s) at masked-in positions; "
                f"check the forward pass (or reward) that produced it"
            )
        if what == "mask":
            odd = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
            raise ValueError(f"mask: values must be 0 or 1, found {odd}; pass a bool or 0/1 response mask")
        raise ValueError(what)


def check_dual_clip(dual_clip: float | None) -> None:
    """dual_clip caps the ratio of negative-advantage tokens (verl's clip_ratio_c); None = off."""
    if dual_clip is not None and not (
        isinstance(dual_clip, (int, float)) and math.isfinite(dual_clip) and dual_clip > 1.0
    ):
        raise ValueError(
            f"dual_clip: {dual_clip} must be a number > 1 (verl's clip_ratio_c, 3.0), or None to turn it off"
        )


def check_normalizer(normalizer: float | Tensor | None) -> None:
    """A python-number normalizer must be finite and > 0 (tensors are checked in policy_loss's one sync)."""
    if normalizer is None or isinstance(normalizer, Tensor):
        return
    if not (math.isfinite(normalizer) and normalizer > 0):
        raise ValueError(f"normalizer: {normalizer} must be finite and > 0 (the update's token or sequence count)")


def check_ratio_bounds(lower: float, upper: float) -> None:
    """Ratio bounds are ratios, not epsilons: 0 <= lower < 1 < upper."""
    if not 0.0 <= lower < 1.0:
        raise ValueError(
            f"lower: ratio bound {lower} must lie in [0, 1); it is a ratio, not an epsilon (PPO's eps=0.2 is lower=0.8)"
        )
    if not upper > 1.0:
        raise ValueError(
            f"upper: ratio bound {upper} must be > 1; it is a ratio, not an epsilon (PPO's eps=0.2 is upper=1.2)"
        )


def per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """Advantages [B] (one per sequence) or [B, T] as [B, T] shaped like `like`."""
    return (advantages[:, None] if advantages.dim() == 1 else advantages).expand_as(like)
