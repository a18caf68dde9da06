"""The lab's task and policy: a tabular softmax over a small token tree, one copy per seed.

Task ("guess and check"): P prompts, each with one answer token out of V. A response is a
sequence of guesses, one token per step; it stops at the first correct guess (reward 1, length
t+1) and otherwise runs to the budget D (reward 0, length D). So failures are structurally
longer than successes, and every wrong guess of a success shares its positive advantage.

Policy: one logit vector per state (prompt p, depth t): logits [S, P, D, V] for S seeds. Each
state has its own softmax, so the Entropy-Clip Rule's softmax derivation is exact here. The start
logits are a random "pretrained" prior with the answer made rare: pi(answer | p, t) = q_p with
q_p log-uniform in `answer_prob`, so correct responses start rare and differ by prompt.

Filler positions (`GuessTask.filler` = k > 0, the regime lab): each guess step is k filler tokens
followed by the guess, L = D * (k + 1) positions per response, each position its own softmax over
the V tokens (state (p, position)). Filler tokens never change the reward; a response still stops
at its first correct guess (after that guess's fillers). With k = 0 (the default) L = D and every
position is a guess, the task above exactly.

Everything is exact where it can be: log-probs and entropies are read from the table, and the
expected reward and on-policy token entropy come in closed form from the reach probabilities
reach[p, t] = prod_{j < t} (1 - pi(answer | p, j)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GuessTask:
    """The task's sizes and start prior (see the module doc).

    prompts: P; vocab: V tokens per state; budget: D guesses (max response length);
    prior_scale: std of the start logits (a peaked, non-uniform prior: 1.0 gives ~3 nats per state
    at V = 32, larger values LLM-like entropies below 1 nat); answer_prob: (low, high) range of the
    start probability of each prompt's answer token (log-uniform per prompt); filler: k
    reward-irrelevant positions before each guess (see the module doc).
    """

    prompts: int = 15
    vocab: int = 32
    budget: int = 8
    prior_scale: float = 1.0
    answer_prob: tuple[float, float] = (0.005, 0.05)
    filler: int = 0

    def __post_init__(self) -> None:
        if self.filler < 0:
            raise ValueError(f"filler: {self.filler} must be >= 0 (filler positions per guess step)")
        if self.prior_scale < 0:
            raise ValueError(f"prior_scale: {self.prior_scale} must be >= 0 (the start logits' std)")
        for name in ("prompts", "vocab", "budget"):
            if getattr(self, name) < (2 if name == "vocab" else 1):
                raise ValueError(f"{name}: {getattr(self, name)} is too small (prompts, budget >= 1; vocab >= 2)")
        low, high = self.answer_prob
        if not 0.0 < low <= high < 1.0:
            raise ValueError(f"answer_prob: {self.answer_prob} must satisfy 0 < low <= high < 1")

    @property
    def positions(self) -> int:
        """L: positions per response, D * (filler + 1)."""
        return self.budget * (self.filler + 1)

    def instance(self, seed: int) -> tuple[Tensor, Tensor]:
        """(start logits [P, L, V] float64, answers [P] int64) of one seed's task instance (L = D
        without filler). The guess positions' logits are drawn first, so they are the same for
        every filler count."""
        gen = torch.Generator().manual_seed(1_000_003 * seed + 17)
        P, D, V = self.prompts, self.budget, self.vocab
        logits = self.prior_scale * torch.randn(P, D, V, generator=gen, dtype=torch.float64)
        answers = torch.randint(V, (P,), generator=gen)
        low, high = math.log(self.answer_prob[0]), math.log(self.answer_prob[1])
        answer_prob = torch.exp(low + (high - low) * torch.rand(P, generator=gen, dtype=torch.float64))
        # Set the answer's logit so that its softmax probability is exactly answer_prob:
        # l_a = log(q / (1 - q)) + logsumexp(other logits).
        is_answer = torch.nn.functional.one_hot(answers, V).bool()[:, None, :].expand(P, D, V)
        others = torch.logsumexp(logits.masked_fill(is_answer, -math.inf), -1)
        answer_logit = torch.log(answer_prob / (1 - answer_prob))[:, None] + others
        logits = torch.where(is_answer, answer_logit[:, :, None].expand(P, D, V), logits)
        if self.filler:  # [P, D, k + 1, V]: k filler positions, then the guess, per step
            k = self.filler
            filler = self.prior_scale * torch.randn(P, D, k, V, generator=gen, dtype=torch.float64)
            logits = torch.cat([filler, logits[:, :, None]], 2).reshape(P, D * (k + 1), V)
        return logits, answers


def guess_positions(positions: int, filler: int = 0) -> Tensor:
    """[L] bool: True at the guess positions (the last of each block of filler + 1)."""
    return torch.arange(positions) % (filler + 1) == filler


@dataclass
class Rollouts:
    """One rollout batch for S seeds, B = P * G rows per seed (each prompt's G rows contiguous).

    prompt [S, B], tokens [S, B, D] (positions past the stop hold unused samples), mask [S, B, D],
    old_log_prob [S, B, D] (behaviour log-probs), rewards [S, B], advantages [S, B], version: the
    policy version (optimizer updates done) that generated it.
    """

    prompt: Tensor
    tokens: Tensor
    mask: Tensor
    old_log_prob: Tensor
    rewards: Tensor
    advantages: Tensor
    version: int


def token_log_probs(logits: Tensor, prompt: Tensor, tokens: Tensor) -> Tensor:
    """log pi(tokens) [S, B, D] from logits [S, P, D, V], prompt [S, B], tokens [S, B, D]."""
    log_pi = torch.log_softmax(logits, -1)
    S, B, D = tokens.shape
    seed_index = torch.arange(S)[:, None, None].expand(S, B, D)
    depth_index = torch.arange(D)[None, None, :].expand(S, B, D)
    return log_pi[seed_index, prompt[:, :, None].expand(S, B, D), depth_index, tokens]


def state_entropy(logits: Tensor) -> Tensor:
    """Entropy [S, P, D] of every state's softmax."""
    log_pi = torch.log_softmax(logits, -1)
    return -(log_pi.exp() * log_pi).sum(-1)


def token_entropy(logits: Tensor, prompt: Tensor, mask: Tensor) -> Tensor:
    """Exact mean entropy [S] of the states that the masked tokens of a batch sit in (the
    token-mean entropy an LLM trainer logs), per seed. prompt [S, B], mask [S, B, D]."""
    return token_mean(state_entropy(logits), prompt, mask)


def token_mean(per_state: Tensor, prompt: Tensor, mask: Tensor) -> Tensor:
    """Mean [S] over a batch's masked tokens of a per-state quantity per_state [S, P, L] (each token
    reads its state's value). prompt [S, B], mask [S, B, L]."""
    per_token = torch.gather(per_state, 1, prompt[:, :, None].expand(-1, -1, mask.shape[-1]))
    weight = mask.to(per_token.dtype)
    return (per_token * weight).sum((1, 2)) / weight.sum((1, 2)).clamp_min(1.0)


def exact_stats(logits: Tensor, answers: Tensor, filler: int = 0) -> dict[str, Tensor]:
    """Closed-form on-policy quantities per seed [S]: expected reward (mean over prompts of
    P(some guess is correct)), expected length, and the token entropy under the policy's own
    visitation (sum over states of reach * H / expected tokens). logits [S, P, L, V], answers
    [S, P]. With filler > 0 also entropy/guess and entropy/filler: the same entropy over the guess
    positions and the filler positions only (a filler position is reached with its guess)."""
    log_pi = torch.log_softmax(logits, -1)
    guess_log_pi = log_pi[:, :, filler :: filler + 1] if filler else log_pi
    D = guess_log_pi.shape[2]
    answer_prob = torch.gather(guess_log_pi, 3, answers[:, :, None, None].expand(-1, -1, D, 1)).squeeze(-1).exp()
    miss = (1.0 - answer_prob).clamp_min(0.0)  # [S, P, D]
    reach = torch.cumprod(torch.cat([torch.ones_like(miss[..., :1]), miss[..., :-1]], -1), -1)
    if filler:  # every position of guess step t is reached with probability reach[t]
        reach = reach.repeat_interleave(filler + 1, -1)  # [S, P, L]
    entropy = -(log_pi.exp() * log_pi).sum(-1)
    tokens = reach.sum(-1)  # expected length [S, P]
    stats = {
        "reward": (1.0 - reach[..., -1] * miss[..., -1]).mean(-1),
        "length": tokens.mean(-1),
        "entropy": (reach * entropy).sum((1, 2)) / tokens.sum(-1),
    }
    if filler:
        guess = guess_positions(logits.shape[2], filler).to(reach.dtype)
        for name, weight in (("guess", guess), ("filler", 1.0 - guess)):
            weighted = reach * weight
            stats[f"entropy/{name}"] = (weighted * entropy).sum((1, 2)) / weighted.sum((1, 2))
    return stats


def sample(
    logits: Tensor, answers: Tensor, group_size: int, generators: list[torch.Generator], filler: int = 0
) -> dict[str, Tensor]:
    """G responses per prompt for every seed, each seed from its own generator (so a seed's
    draws do not depend on which other seeds run). logits [S, P, L, V] (L = D * (filler + 1));
    only guess positions can be correct. Returns prompt [S, B], tokens [S, B, L], mask [S, B, L],
    rewards [S, B] (float64), log_prob [S, B, L]."""
    S, P, D, V = logits.shape
    G = group_size
    uniform = torch.stack([torch.rand(P, G, D, generator=g, dtype=logits.dtype) for g in generators])
    cdf = torch.softmax(logits, -1).cumsum(-1)  # [S, P, D, V]
    tokens = (uniform[..., None] > cdf[:, :, None]).sum(-1).clamp_max(V - 1)  # inverse CDF, [S, P, G, D]
    correct = tokens == answers[:, :, None, None]
    if filler:
        correct = correct & guess_positions(D, filler)
    solved = correct.any(-1)
    first = torch.where(solved, correct.float().argmax(-1), torch.full_like(solved, D - 1, dtype=torch.long))
    mask = torch.arange(D) <= first[..., None]  # up to and including the stop
    prompt = torch.arange(P)[None, :, None].expand(S, P, G).reshape(S, P * G)
    tokens = tokens.reshape(S, P * G, D)
    return {
        "prompt": prompt,
        "tokens": tokens,
        "mask": mask.reshape(S, P * G, D),
        "rewards": solved.reshape(S, P * G).to(torch.float64),
        "log_prob": token_log_probs(logits, prompt, tokens),
    }
