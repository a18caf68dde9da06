"""Train the tabular policy of every seed of one cell (method x setting), vectorised over seeds.

The two off-policy axes are the trainer's own (bapo.train), not a copy:
- staleness E (the paper's Algorithm 1): E + 1 optimizer updates per rollout batch, the batch
  split into E + 1 mini-batches by `bapo.train.buffer.minibatch_order` (what
  `Trainer.update_step` runs with offpolicy.mini_batches = E + 1), bounds re-searched before each;
- async delay k (a FIFO, the asynchronous-pipeline kind): each batch trained once, k rollout steps
  late, through `bapo.train.buffer.BatchBuffer` with offpolicy.async_delay = k (warm-up: the first
  k batches come from the start policy, as in `Trainer.fit`).

Per update: one `bapo.core.policy_loss` call over the rows of all seeds, aggregated as a token sum
and divided per seed by that seed's token count, which is exactly each seed's own token-mean
gradient (seeds share no parameter). BAPO searches its bounds per seed (one `BAPOStep` each) and
the loss runs once per distinct pair of bounds. Plain SGD on the logits: the Entropy-Clip Rule is
derived for a gradient step on softmax logits.

The regime lab (bapo.lab.regimes) varies what the default fixes, each a LabConfig field whose
default is the lab above: the optimizer (SGD or Adam, elementwise, so still per seed), the
parameters (the table, or shared: a fixed prior plus prompt, position and state blocks, so an
update to one state moves the others of its prompt and position), the split of staleness E (E + 1
mini-batches, or E + 1 full-batch epochs), and `premise`: the Entropy-Clip premise diagnostic
and the first-order / remainder split of each update's exact entropy change, at every update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from bapo.core import (
    BATCH_LEVEL_METHODS,
    POLICY_LOSSES,
    PROXIMAL_METHODS,
    BAPOConfig,
    BAPOStep,
    TokenBatch,
    clip_diagnostics,
    group_advantages,
    off_policy_sequence_mask,
    policy_loss,
    positive_share,
    token_ratio,
)
from bapo.lab.policy import (
    GuessTask,
    Rollouts,
    exact_stats,
    sample,
    state_entropy,
    token_log_probs,
    token_mean,
)
from bapo.train.buffer import BatchBuffer, minibatch_order
from bapo.train.config import ICEPOP_BOUNDS, TrainConfig
from bapo.train.config_io import config_from_dict
from bapo.train.correction import correction_weights

try:  # the adaptive target (BAPOConfig.target_mode="entropy"), where this checkout has it
    from bapo.core.target import EntropyTargetController
except ImportError:  # pragma: no cover - depends on the core version
    EntropyTargetController = None  # type: ignore[assignment,misc]

# The methods the lab compares: name -> (registered policy loss, its parameters). A new variant
# is one more line here.
METHODS: dict[str, tuple[str, dict]] = {
    "grpo": ("grpo", {}),  # [0.8, 1.2]
    "clip-higher": ("clip-higher", {}),  # [0.8, 1.28]
    "dual-clip": ("dual-clip", {}),  # [0.8, 1.2] + cap 3.0 on negative ratios
    "bapo": ("bapo", {"bapo": BAPOConfig()}),  # paper defaults, target share 0.4
    "grpo-c_high=2.0": ("grpo", {"upper": 2.0}),  # claim 2: raised c_high
    "grpo-c_low=0.6": ("grpo", {"lower": 0.6}),  # claim 2: lowered c_low
}

# BAPO's two search stages apart (the regime lab): GRPO with c_high fixed at the search's maximum
# (admitting positive tokens), with c_low fixed at its maximum (filtering negative tokens), and
# both. Outside METHODS, so the default plan does not run them; aggregated like METHODS entries.
_SEARCH = BAPOConfig()
STAGE_C_HIGH = f"grpo-c_high={_SEARCH.upper_max:g}"
STAGE_C_LOW = f"grpo-c_low={_SEARCH.lower_max:g}"
STAGE_BOTH = f"grpo-c_low={_SEARCH.lower_max:g}-c_high={_SEARCH.upper_max:g}"
STAGE_METHODS: dict[str, tuple[str, dict]] = {
    STAGE_C_HIGH: ("grpo", {"upper": _SEARCH.upper_max}),
    STAGE_C_LOW: ("grpo", {"lower": _SEARCH.lower_max}),
    STAGE_BOTH: ("grpo", {"lower": _SEARCH.lower_max, "upper": _SEARCH.upper_max}),
}
OPTIMIZERS = ("sgd", "adam")
PARAMETERS = ("table", "shared")
SPLITS = ("mini-batches", "epochs")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch's defaults
PREMISE_KEYS = tuple(f"premise/{sign}_{kind}_low_share" for sign in ("pos", "neg") for kind in ("clipped", "kept"))
if EntropyTargetController is not None:  # rho0 steered so that entropy holds its early level
    METHODS["bapo-entropy"] = ("bapo", {"bapo": BAPOConfig(target_mode="entropy")})


# Methods outside the default plan, by name (`bapo lab --async-delays`): no trust region at all, the
# surrogate -r A that M2PO's paper compares with clipped GRPO on stale data
EXTRA_METHODS: dict[str, tuple[str, dict]] = {"unclipped": ("grpo", {"lower": 0.0, "upper": math.inf})}


# Peers that are not a loss but a weight on one (`bapo lab --peers`), each on GRPO's clipped
# surrogate at its defaults, nothing tuned:
# - icepop: verl's decoupled mode with token-level IcePop (RolloutCorrectionConfig.decoupled_token_icepop):
#   the ratio is taken against the recomputed old policy (the one before the rollout batch's first
#   update, decoupled PPO's proximal policy) and the behaviour gap pi_prox / mu is the correction
#   weight, zeroed outside ICEPOP_BOUNDS (bapo.train.correction, `rollout.correction=icepop`);
# - opsm: TRL's off_policy_mask_threshold (DeepSeek-V3.2's OPSM) at OPSM_THRESHOLD, TRL's documented
#   example value: a negative-advantage response whose mean log(mu / pi) exceeds it is dropped
#   (bapo.core.off_policy_sequence_mask, `loss.off_policy_mask`).
WEIGHTED_METHODS: dict[str, tuple[str, dict]] = {"icepop": ("grpo", {}), "opsm": ("grpo", {})}
OPSM_THRESHOLD = 0.5
# the methods whose rollout batches carry the proximal log-probs (the policy before their first update)
NEEDS_PROXIMAL = ("icepop",)


def method_loss(name: str) -> tuple[str, dict]:
    """A lab method's registered loss and parameters: its METHODS, STAGE_METHODS, EXTRA_METHODS or
    WEIGHTED_METHODS entry, or any other registered loss by its own name with its defaults (e.g.
    Cell("gspo")), outside the default plan. Decoupled PPO's proximal policy is the one before the
    first update of each rollout batch, as in `bapo train`."""
    for named in (METHODS, STAGE_METHODS, EXTRA_METHODS, WEIGHTED_METHODS):
        if name in named:
            return named[name]
    if name in POLICY_LOSSES:
        return name, {}
    raise ValueError(
        f"method: {name!r} is not one of "
        f"{sorted(METHODS) + sorted(STAGE_METHODS) + sorted(EXTRA_METHODS) + sorted(WEIGHTED_METHODS)} "
        "nor a registered loss "
        "the lab can run "
        f"({sorted(set(POLICY_LOSSES) - set(METHODS))})"
    )


@dataclass(frozen=True)
class Cell:
    """One setting: a method of METHODS at staleness E (E+1 updates per rollout batch) or with
    an async delay of k rollout steps (each batch trained once)."""

    method: str
    staleness_e: int = 0
    async_delay: int = 0

    @property
    def name(self) -> str:
        return f"{self.method} E={self.staleness_e}" + (f" delay={self.async_delay}" if self.async_delay else "")


@dataclass(frozen=True)
class LabConfig:
    """The regime (see docs/LAB.md for why these values).

    lr: SGD step on the logits; group_size: G responses per prompt; rollout_steps: per cell
    (equal samples in every cell; updates = rollout_steps * (E + 1)); seeds: how many; share_methods:
    methods whose per-seed positive share is recorded at every update (BAPO's comes from its
    search); check_cells: cells whose full per-seed `clip_diagnostics` (entropy-change estimate,
    clip fractions) are recorded at every update. Both cost one host sync per seed and update.

    Regime fields (bapo.lab.regimes; the defaults are the lab above): optimizer "sgd" | "adam"
    (lr is Adam's step size then); parameters "table" | "shared" (see LabPolicy); split
    "mini-batches" (E + 1 mini-batches per rollout batch) | "epochs" (E + 1 full-batch updates);
    premise: record premise/* (bapo.core's diagnostic, split per state by log pi < -H) and
    entropy/first_order, entropy/remainder at every update of every cell. With task.filler = k,
    SGD's lr is multiplied by k + 1, so each position moves as much as without filler (the
    token-mean loss has k + 1 times the tokens); Adam's step is scale-free and is not.
    """

    task: GuessTask = field(default_factory=GuessTask)
    lr: float = 100.0
    group_size: int = 12
    rollout_steps: int = 24
    seeds: int = 20
    first_seed: int = 0
    share_methods: tuple[str, ...] = ("grpo", "bapo")
    check_cells: tuple[str, ...] = ("grpo E=0", "grpo E=4", "bapo E=4")
    optimizer: str = "sgd"
    parameters: str = "table"
    split: str = "mini-batches"
    premise: bool = False

    def __post_init__(self) -> None:
        for name, options in (("optimizer", OPTIMIZERS), ("parameters", PARAMETERS), ("split", SPLITS)):
            if getattr(self, name) not in options:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {list(options)}")
        if not self.lr > 0:
            raise ValueError(f"lr: {self.lr} must be > 0")

    @property
    def step_size(self) -> float:
        """The optimizer's step: lr, times filler + 1 for SGD (see the class doc)."""
        return self.lr * (self.task.filler + 1) if self.optimizer == "sgd" else self.lr

    def train_config(self, cell: Cell, seed: int = 0) -> TrainConfig:
        """The bapo.train config whose off-policy semantics this cell runs (it validates E and k:
        E + 1 must divide the P * G rows of a batch)."""
        return config_from_dict(
            {
                "model": {"path": "bapo-lab:tabular"},
                "rollout": {
                    "prompts_per_batch": self.task.prompts,
                    "group_size": self.group_size,
                    "max_new_tokens": self.task.positions,
                },
                "offpolicy": {"async_delay": cell.async_delay, **self._updates_per_batch(cell)},
                "run": {"rollout_steps": self.rollout_steps, "seed": seed, "progress": False},
            }
        )

    def _updates_per_batch(self, cell: Cell) -> dict:
        # the lab's split shuffles rows across groups (minibatch_order's group_size 1), the split its
        # committed results were made with; bapo train's default keeps groups whole
        if self.split == "epochs":
            return {"mini_batches": 1, "epochs": cell.staleness_e + 1, "minibatch_split": "rows"}
        return {"mini_batches": cell.staleness_e + 1, "minibatch_split": "rows"}


class LabPolicy:
    """The trainable policy of every seed of a cell and its optimizer.

    prior: start logits [S, P, L, V]. parameters "table": the logits themselves are the parameter
    (one softmax per state, the default). "shared": logits = prior + W_prompt[p] + W_position[l]
    + W_state[p, l] (state features = one-hot prompt, position and state blocks, times a weight
    matrix; W [S, P, 1, V], [S, 1, L, V], [S, P, L, V] start at 0, the prior stays fixed), so a
    gradient on one state moves every state of its prompt and of its position, as in a network.
    step(): SGD or Adam (torch's defaults) on each parameter, elementwise, so seeds stay apart.
    """

    def __init__(self, prior: Tensor, cfg: LabConfig):
        self.cfg = cfg
        self.prior = prior
        if cfg.parameters == "table":
            self.params = [prior.clone().requires_grad_(True)]
        else:
            S, P, L, V = prior.shape
            shapes = ((S, P, 1, V), (S, 1, L, V), (S, P, L, V))
            self.params = [torch.zeros(shape, dtype=prior.dtype, requires_grad=True) for shape in shapes]
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        self.steps = 0

    def logits(self) -> Tensor:
        """[S, P, L, V], differentiable in the parameters."""
        if self.cfg.parameters == "table":
            return self.params[0]
        prompt_block, position_block, state_block = self.params
        logits: Tensor = self.prior + prompt_block + position_block + state_block
        return logits

    @torch.no_grad()
    def step(self, per_seed_scale: Tensor) -> Tensor:
        """One optimizer update from the parameters' .grad, each seed's divided by per_seed_scale
        [S] (its token count: a token mean); returns the scaled gradient's norm per seed [S]."""
        grads = [_grad(p) / per_seed_scale.reshape(-1, *[1] * (p.dim() - 1)) for p in self.params]
        self.steps += 1
        lr = self.cfg.step_size
        for param, grad, (first, second) in zip(self.params, grads, self.moments):
            if self.cfg.optimizer == "sgd":
                param -= lr * grad
                continue
            (beta1, beta2), t = ADAM_BETAS, self.steps
            first.mul_(beta1).add_(grad, alpha=1 - beta1)
            second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (second / (1 - beta2**t)).sqrt_().add_(ADAM_EPS)
            param.addcdiv_(first, denom, value=-lr / (1 - beta1**t))
        norm: Tensor = torch.cat([g.flatten(1) for g in grads], 1).norm(dim=1)
        return norm


def _grad(param: Tensor) -> Tensor:
    if param.grad is None:  # pragma: no cover - every parameter is in the loss's graph
        raise RuntimeError("LabPolicy.step: a parameter has no gradient (call backward first)")
    return param.grad


def entropy_split(
    log_pi_before: Tensor,
    entropy_before: Tensor,
    entropy_after: Tensor,
    logit_change: Tensor,
    prompt: Tensor,
    mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """An update's exact entropy change on a batch's tokens, split into the Entropy-Clip Rule's
    first-order term and the rest, per seed [S]: (first_order, exact change).

    log_pi_before [S, P, L, V] and entropy_before / entropy_after [S, P, L] around the update,
    logit_change [S, P, L, V] (after - before); prompt [S, B], mask [S, B, L]. Per state, the
    first-order change of entropy for a logit change dz is -Cov_pi(log pi, dz) (exact for a
    softmax; the rule's -eta Cov(log pi(y), A X) is this for one SGD step on a table); both are
    averaged over the states of the masked tokens, as entropy/batch_change is."""
    first = _first_order(log_pi_before, entropy_before, logit_change)
    return token_mean(first, prompt, mask), token_mean(entropy_after - entropy_before, prompt, mask)


def _first_order(log_pi: Tensor, entropy: Tensor, change: Tensor) -> Tensor:
    """-Cov_pi(log pi, dz) per state [S, P, L] from log pi [S, P, L, V], entropy [S, P, L], dz."""
    return -(log_pi.exp() * (log_pi + entropy[..., None]) * change).sum(-1)


@dataclass
class CellRun:
    """Per-update series of one cell, each a tensor [S, U] (U = optimizer updates; exact/* are the
    closed-form on-policy stats after the update), and those stats of the start policy [S]."""

    cell: Cell
    seeds: list[int]
    updates: dict[str, Tensor] = field(default_factory=dict)
    start: dict[str, Tensor] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)  # version that generated each update's batch


def _rollout(
    logits: Tensor, answers: Tensor, cfg: LabConfig, generators: list[torch.Generator], version: int
) -> Rollouts:
    drawn = sample(logits.detach(), answers, cfg.group_size, generators, cfg.task.filler)
    advantages, _ = group_advantages(drawn["rewards"].flatten(), cfg.group_size)
    seed_count = logits.shape[0]
    return Rollouts(
        drawn["prompt"],
        drawn["tokens"],
        drawn["mask"],
        drawn["log_prob"],
        drawn["rewards"],
        advantages.reshape(seed_count, -1).to(torch.float64),
        version,
    )


def _loss_groups(
    method: str, params: dict, seed_batches: list[TokenBatch], steps: list[BAPOStep] | None = None
) -> tuple[list[tuple[list[int], dict]], dict[str, Tensor]]:
    """Seeds grouped by the loss parameters they use: [(seed indices, params)], and per-seed
    search results ({} for fixed bounds). seed_batches: what the search reads of each seed's
    mini-batch. A fixed-bound method is one group; BAPO searches its bounds per seed (as the
    trainer does per update: `steps`, one BAPOStep per seed, each begun for this update) and
    seeds that found the same bounds share a group."""
    seed_count = len(seed_batches)
    if method in BATCH_LEVEL_METHODS:  # selections over the batch: each seed's own
        return [([seed], params) for seed in range(seed_count)], {}
    if method != "bapo":
        return [(list(range(seed_count)), params)], {}
    if steps is None:
        raise ValueError("steps: method 'bapo' needs one BAPOStep per seed (BAPOStep(config) for each)")
    groups: dict[tuple[float, float], list[int]] = {}
    share = torch.zeros(seed_count, dtype=torch.float64)
    reached = torch.zeros(seed_count, dtype=torch.float64)
    for seed, step in enumerate(steps):
        found = step.bounds_for(seed_batches[seed])  # one micro-batch: the update
        groups.setdefault((found.lower, found.upper), []).append(seed)
        share[seed], reached[seed] = found.positive_share, float(found.reached)
    rest = {name: value for name, value in params.items() if name != "bapo"}
    return [(members, {**rest, "bounds": bounds}) for bounds, members in groups.items()], {
        "positive_share": share,
        "bapo/search/reached": reached,
    }


def _update(
    policy: LabPolicy,
    answers: Tensor,
    batch: Rollouts,
    rows: Tensor,
    cell: Cell,
    cfg: LabConfig,
    share: bool,
    check: bool,
    steps: list[BAPOStep] | None = None,
    proximal_log_prob: Tensor | None = None,
) -> dict[str, Tensor]:
    """One optimizer update of every seed on its mini-batch rows [S, b]; returns per-seed metrics [S].
    proximal_log_prob [S, B, D]: the batch's log-probs before its first update (decoupled PPO only)."""
    method, params = method_loss(cell.method)
    # a METHODS entry's own aggregation (all token sums at normalizer 1); another loss's token sum
    named_methods = (METHODS, STAGE_METHODS, EXTRA_METHODS, WEIGHTED_METHODS)
    agg_mode = None if any(cell.method in named for named in named_methods) else "token-mean"
    seed_count = rows.shape[0]

    def pick(values: Tensor) -> Tensor:  # each seed's mini-batch rows of a [S, B] or [S, B, D] tensor
        index = rows[:, :, None].expand(-1, -1, values.shape[-1]) if values.dim() == 3 else rows
        return torch.gather(values, 1, index)

    prompt, tokens, mask = pick(batch.prompt), pick(batch.tokens), pick(batch.mask)
    old_log_prob, advantages = pick(batch.old_log_prob), pick(batch.advantages)
    proximal = None if proximal_log_prob is None else pick(proximal_log_prob)
    length = tokens.shape[-1]
    logits = policy.logits()
    before = logits.detach().clone()  # the table's logits are the parameter, updated in place below
    log_pi_before = torch.log_softmax(before, -1)
    states_before = -(log_pi_before.exp() * log_pi_before).sum(-1)  # state_entropy(before), once
    entropy_before = token_mean(states_before, prompt, mask)

    log_prob = token_log_probs(logits, prompt, tokens)
    weights = None
    if cell.method == "icepop" and proximal is not None:  # decoupled: the ratio against the recomputed policy
        lower, cap = ICEPOP_BOUNDS
        weights, _ = correction_weights(proximal, old_log_prob, mask, "icepop", "token", cap=cap, lower=lower)
        old_log_prob, proximal = proximal, None
    elif cell.method == "opsm":  # the sampler is the behaviour policy (no engine gap here)
        per_token_advantages = advantages[..., None].expand_as(log_prob)
        weights = off_policy_sequence_mask(log_prob, old_log_prob, per_token_advantages, mask, OPSM_THRESHOLD)
    ratio = token_ratio(log_prob.detach(), old_log_prob)
    lower, upper = torch.zeros(seed_count, dtype=torch.float64), torch.zeros(seed_count, dtype=torch.float64)
    total = torch.zeros((), dtype=logits.dtype)
    # what BAPO's search and the positive share read of each seed's mini-batch
    seed_batches = [
        TokenBatch(ratio=ratio[seed], advantages=advantages[seed], mask=mask[seed], old_log_prob=old_log_prob[seed])
        for seed in range(seed_count)
    ]
    groups, searched = _loss_groups(method, params, seed_batches, steps)
    for members, group_params in groups:
        # a token sum (normalizer 1), made each seed's token mean below
        loss, metrics = policy_loss(
            log_prob[members].reshape(-1, length),
            old_log_prob[members].reshape(-1, length),
            advantages[members].reshape(-1),
            mask[members].reshape(-1, length),
            method,
            loss_agg_mode=agg_mode,
            normalizer=1.0,
            **({} if proximal is None else {"proximal_log_prob": proximal[members].reshape(-1, length)}),
            **({} if weights is None else {"importance_weights": weights[members].reshape(-1, length)}),
            **group_params,
        )
        lower[members], upper[members] = metrics["lower"], metrics["upper"]
        total = total + loss
    for param in policy.params:
        param.grad = None
    total.backward()
    grad_norm = policy.step(mask.sum((1, 2)).clamp_min(1).to(logits.dtype))
    after = policy.logits().detach()
    states_after = state_entropy(after)
    out = {
        "grad_norm": grad_norm,
        "entropy/batch": entropy_before,
        "entropy/batch_change": token_mean(states_after, prompt, mask) - entropy_before,
        "lower": lower,
        "upper": upper,
        "reward/batch": pick(batch.rewards).mean(1),
        **{f"exact/{name}": value for name, value in exact_stats(after, answers, cfg.task.filler).items()},
    }
    if cfg.premise:  # the change just measured, split: the rule's first-order term and the rest
        first_order, change = entropy_split(log_pi_before, states_before, states_after, after - before, prompt, mask)
        out["entropy/first_order"] = first_order
        out["entropy/remainder"] = change - first_order
    out.update(searched)
    # A mini-batch whose advantages are all zero (every group solved or every group failed) has no
    # share to balance and no entropy change: its share-like metrics are missing (NaN), not 1.0.
    no_signal = ~((advantages[:, :, None] != 0) & mask).flatten(1).any(1)
    if check or cfg.premise:  # the full per-seed diagnostics of bapo.core (one call per seed)
        keys: tuple[str, ...] = ()
        if check:
            keys = ("positive_share", "entropy_change_estimate", "clip_frac/upper", "clip_frac/lower", "clip_frac")
        if cfg.premise:  # split per state by log pi < -H (the per-token entropy of its state)
            keys += PREMISE_KEYS + (() if check or not share else ("positive_share",))
            per_token_entropy = torch.gather(states_before, 1, prompt[:, :, None].expand(-1, -1, length))
        per_seed = [
            clip_diagnostics(
                log_prob[seed].detach(),
                old_log_prob[seed],
                advantages[seed],
                mask[seed],
                float(lower[seed]),
                float(upper[seed]),
                **({"entropy": per_token_entropy[seed]} if cfg.premise else {}),
            )
            for seed in range(seed_count)
        ]
        out.update({key: torch.tensor([metrics[key] for metrics in per_seed], dtype=torch.float64) for key in keys})
    if share and "positive_share" not in out:
        out["positive_share"] = torch.tensor(
            [positive_share(seed_batches[seed], float(lower[seed]), float(upper[seed])) for seed in range(seed_count)],
            dtype=torch.float64,
        )
    for key in ("positive_share", "bapo/search/reached", "entropy_change_estimate"):
        if key in out:
            out[key] = out[key].masked_fill(no_signal, float("nan"))
    return out


def run_cell(cell: Cell, cfg: LabConfig) -> CellRun:
    """Train every seed of `cell` for cfg.rollout_steps rollout steps; deterministic per seed."""
    method_loss(cell.method)  # a method the lab can run, or ValueError naming them
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    train_cfg = cfg.train_config(cell)  # validates E and k the way `bapo train` does
    instances = [cfg.task.instance(seed) for seed in seeds]
    policy = LabPolicy(torch.stack([start for start, _ in instances]), cfg)
    answers = torch.stack([answer for _, answer in instances])
    # Per-seed rollout generators, the same in every cell: paired comparisons share the draws
    # until the policies differ.
    generators = [torch.Generator().manual_seed(7_777_777 * seed + 1) for seed in seeds]
    run = CellRun(cell, seeds)
    series: dict[str, list[Tensor]] = {}
    run.start = exact_stats(policy.logits().detach(), answers, cfg.task.filler)
    buffer = BatchBuffer(train_cfg, pad_id=0)
    version = 0
    while len(buffer.batches) < buffer.warmup:  # FIFO warm-up: batches of the start policy
        buffer.push(_rollout(policy.logits(), answers, cfg, generators, version))
    rows_per_batch = cfg.task.prompts * cfg.group_size
    method, params = method_loss(cell.method)
    # One BAPOStep per seed (its adaptive target fed the entropy of each update, as a trainer would).
    steps = [BAPOStep(params.get("bapo", BAPOConfig())) for _ in seeds] if method == "bapo" else []
    adaptive = bool(steps) and steps[0].config.target_mode == "entropy"
    for rollout_step in range(cfg.rollout_steps):
        buffer.push(_rollout(policy.logits(), answers, cfg, generators, version))
        batch: Rollouts = buffer.pop(rollout_step)
        split = cfg._updates_per_batch(cell)
        schedules = [
            minibatch_order(rows_per_batch, split["mini_batches"], split.get("epochs", 1), seed, rollout_step)
            for seed in seeds
        ]
        proximal = None
        if method in PROXIMAL_METHODS or cell.method in NEEDS_PROXIMAL:  # the policy before the first update
            proximal = token_log_probs(policy.logits().detach(), batch.prompt, batch.tokens)
        for update in range(cell.staleness_e + 1):
            rows = torch.stack([schedule[update][1] for schedule in schedules])
            for step in steps:
                step.begin(micro_batches=1)
            metrics = _update(
                policy,
                answers,
                batch,
                rows,
                cell,
                cfg,
                cell.method in cfg.share_methods,
                cell.name in cfg.check_cells,
                steps or None,
                proximal,
            )
            if adaptive:
                metrics["bapo/target"] = torch.tensor([step.target for step in steps], dtype=torch.float64)
            for step, entropy in zip(steps, metrics["entropy/batch"].tolist()):
                step.end(entropy)
            if adaptive:
                set_points = [step.controller.set_point for step in steps]
                metrics["bapo/set_point"] = torch.tensor(
                    [math.nan if point is None else point for point in set_points], dtype=torch.float64
                )
            # the trainer's name: optimizer updates between the behaviour policy and this update
            metrics["policy_lag/mean"] = torch.full((len(seeds),), float(version - batch.version), dtype=torch.float64)
            for key, value in metrics.items():
                series.setdefault(key, []).append(value.double())
            run.versions.append(batch.version)
            version += 1
    run.updates = {key: torch.stack(values, 1) for key, values in series.items()}
    return run
