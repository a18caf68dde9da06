"""Group-normalised advantages (GRPO) from one scalar reward per response."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
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


def smooth_advantages(
    rewards: Tensor,
    group_size: int,
    history_mean: Tensor,
    history_std: Tensor,
    history_steps: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DCPO's smooth advantage standardisation (SAS, arXiv 2509.02333), for one rollout step.

    rewards: [N], N = P prompts * group_size, each prompt's responses contiguous. history_*: [P]
    per prompt over its earlier rollout steps: the running mean and std of its step statistics
    and how many steps it had (0 = never seen; mean/std are then ignored). With i = steps + 1
    (this step included), this step's group mean m and std s (unbiased), the cumulative
        mean_i = ((i-1) mean + m) / i
        var_i  = ((i-1) std^2 + s^2 + (i-1)/i (m - mean)^2) / i        (mean_1 = m, std_1 = s)
    and the two standardised rewards A_new = (R - m) / s, A_total = (R - mean_i) / std_i (0 where
    the std is 0), the advantage is whichever of
        (1/i) A_total + (1 - 1/i) A_new   and   (1/i) A_new + (1 - 1/i) A_total
    has the smaller magnitude (DCPO's code; no eps). A zero-variance group gets a non-zero
    advantage once its prompt has history, the point of SAS.
    Returns advantages [N] and the updated (mean, std, steps) [P] the caller keeps per prompt
    (and in its checkpoint) for the prompt's next rollout step.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape [N], got {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_size: {group_size} must be >= 2 and divide the number of rewards ({rewards.numel()})")
    prompts = rewards.numel() // group_size
    for name, tensor in (
        ("history_mean", history_mean),
        ("history_std", history_std),
        ("history_steps", history_steps),
    ):
        if tuple(tensor.shape) != (prompts,):
            raise ValueError(f"{name}: expected shape [{prompts}] (one per prompt), got {tuple(tensor.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards: contains NaN or inf; a verifier must return a finite float")
    grouped = rewards.double().reshape(prompts, group_size)
    step_mean, step_std = grouped.mean(-1), grouped.std(-1)
    previous = history_steps.double()
    count = previous + 1.0
    old_mean, old_std = history_mean.double(), history_std.double()
    seen = previous > 0
    mean = torch.where(seen, (old_mean * previous + step_mean) / count, step_mean)
    variance = (previous * old_std**2 + step_std**2 + previous / count * (step_mean - old_mean) ** 2) / count
    std = torch.where(seen, variance.sqrt(), step_std)

    def standardised(centre: Tensor, scale: Tensor) -> Tensor:
        return torch.where(scale[:, None] > 0, (grouped - centre[:, None]) / scale[:, None].clamp_min(1e-300), 0.0)

    new, total = standardised(step_mean, step_std), standardised(mean, std)
    weight = (1.0 / count)[:, None]
    first, second = weight * total + (1 - weight) * new, weight * new + (1 - weight) * total
    advantages = torch.where(first.abs() < second.abs(), first, second)
    return (
        advantages.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32),
        mean.to(history_mean.dtype),
        std.to(history_std.dtype),
        history_steps + 1,
    )


class PromptRewardHistory:
    """Each prompt's running reward statistics across rollout steps, for `smooth_advantages`
    (DCPO's SAS). Keys are any hashable prompt id (its dataset index, its text); the state is a
    plain dict for a checkpoint (state_dict / load_state_dict)."""

    def __init__(self) -> None:
        self.stats: dict[Hashable, tuple[float, float, int]] = {}  # prompt -> (mean, std, steps)

    def advantages(self, prompt_keys: Sequence[Hashable], rewards: Tensor, group_size: int) -> Tensor:
        """SAS advantages [N] for one rollout step; prompt_keys: [P] (one per group, in the order of
        the groups in rewards [N = P * group_size]). Updates the history of those prompts."""
        if len(prompt_keys) * group_size != rewards.numel():
            raise ValueError(
                f"prompt_keys: {len(prompt_keys)} prompts x group_size {group_size} != "
                f"{rewards.numel()} rewards; pass one key per group"
            )
        if len(set(prompt_keys)) != len(prompt_keys):
            raise ValueError("prompt_keys: a prompt appears twice in one step; give each group its own key")
        known = [self.stats.get(key, (0.0, 0.0, 0)) for key in prompt_keys]
        mean, std, steps = (
            torch.tensor(column, dtype=dtype)
            for column, dtype in zip(zip(*known), (torch.float64, torch.float64, torch.int64))
        )
        advantages, mean, std, steps = smooth_advantages(rewards, group_size, mean, std, steps)
        for key, values in zip(prompt_keys, zip(mean.tolist(), std.tolist(), steps.tolist())):
            self.stats[key] = values
        return advantages

    def state_dict(self) -> dict:
        return {"stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {key: tuple(values) for key, values in state["stats"].items()}
