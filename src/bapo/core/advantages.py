"""Group-normalised advantages (GRPO) from one scalar reward per response."""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """A_i = (r_i - mean(group)) / (std(group) + eps); scale_by_std=False is Dr.GRPO's r_i - mean.

    rewards: [N] with N = prompts * group_size, each prompt's responses contiguous.
    Returns advantages [N] (exactly 0 in zero-variance groups) and zero_variance [N] bool.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape [N], got {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size: {group_size} must divide the number of rewards ({rewards.numel()})")
    if torch.isnan(rewards).any():
        raise ValueError("rewards: contains NaN; a verifier must return a finite float")
    grouped = rewards.float().reshape(-1, group_size)
    centred = grouped - grouped.mean(-1, keepdim=True)
    zero_variance = (grouped == grouped[:, :1]).all(-1, keepdim=True).expand_as(grouped)
    if scale_by_std and group_size > 1:
        centred = centred / (grouped.std(-1, keepdim=True) + eps)
    advantages = torch.where(zero_variance, torch.zeros_like(centred), centred)
    return advantages.reshape(-1), zero_variance.reshape(-1)
