"""Which rollout batch an update trains on: the exact async-delay FIFO or a replay mix.

fifo, async delay k: a queue of k+1 batches. Each rollout step pushes the batch it just generated
and pops the oldest, so rollout step s trains on the batch generated at rollout step s-k. Warm-up:
the first k batches are generated up front by the initial policy (version 0), so rollout steps
0..k-1 train on version-0 data (policy lag 0, U, ..., (k-1)U optimizer updates with U updates per
batch) and from rollout step k on the delay is exactly k batches.
replay: the last `replay_batches` batches are kept; each rollout step trains on prompts_per_batch
groups drawn uniformly without replacement from all of them (ages 0 .. replay_batches-1 mix).
Draws use a generator seeded by (seed, rollout step), so they need no saved state.
"""

from __future__ import annotations

from collections import deque

import torch

from bapo.train.config import TrainConfig
from bapo.train.rollout import Batch
from bapo.train.seeding import MINIBATCH_SPLIT, REPLAY_DRAW, seeded_generator


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices [len(groups) * group_size] of prompt groups `groups` [n] (long) of a batch whose
    groups are `group_size` consecutive rows, group by group in the order given."""
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()


def minibatch_order(
    rows: int, mini_batches: int, epochs: int, seed: int, step: int, group_size: int = 1
) -> list[tuple[int, torch.Tensor]]:
    """The optimizer updates of one rollout batch of `rows` rows at rollout step `step`: a list of
    (epoch, sorted row indices [~rows / mini_batches]) in update order, always epochs x mini_batches
    entries. Rows come in prompt groups of `group_size` consecutive rows (a Batch's layout: rollout,
    partial rollout and replay all keep a group's G responses together), and each epoch shuffles
    the groups with a generator seeded by (seed, step, epoch), then splits them into `mini_batches`
    parts of whole groups that differ by at most one group (no shuffle when mini_batches == 1), so
    the split needs no saved state. A part is empty when there are fewer groups than mini_batches
    (dropped zero-variance groups): an update slot with no data.
    group_size=1 is the row split (offpolicy.minibatch_split=rows): every row its own "group", the
    same generator and draws as before groups were kept whole, so old runs repeat exactly."""
    if rows % group_size:
        raise ValueError(f"minibatch_order: {rows} rows are not whole groups of {group_size}")
    updates: list[tuple[int, torch.Tensor]] = []
    for epoch in range(epochs):
        generator = seeded_generator(seed, step, epoch, weights=MINIBATCH_SPLIT)
        groups = rows // group_size
        order = torch.randperm(groups, generator=generator) if mini_batches > 1 else torch.arange(groups)
        for part in order.tensor_split(mini_batches):
            updates.append((epoch, group_rows(part, group_size).sort().values))
    return updates


class BatchBuffer:
    def __init__(self, cfg: TrainConfig, pad_id: int):
        self.mode, self.async_delay = cfg.offpolicy.mode, cfg.offpolicy.async_delay
        self.capacity = self.async_delay + 1 if self.mode == "fifo" else cfg.offpolicy.replay_batches
        self.group_size, self.groups = cfg.rollout.group_size, cfg.rollout.prompts_per_batch
        self.seed, self.pad_id = cfg.run.seed, pad_id
        self.batches: deque[Batch] = deque()

    @property
    def warmup(self) -> int:
        """Batches to generate with the initial policy before the first update."""
        return self.async_delay if self.mode == "fifo" else 0

    def push(self, batch: Batch) -> None:
        self.batches.append(batch)
        if self.mode == "replay" and len(self.batches) > self.capacity:
            self.batches.popleft()

    def pop(self, rollout_step: int) -> Batch:
        if self.mode == "fifo":
            assert len(self.batches) == self.capacity, "FIFO not full: warm-up missing"
            return self.batches.popleft()
        group_size = self.group_size
        pool = Batch.cat(list(self.batches), self.pad_id)
        n_groups = len(pool) // group_size
        generator = seeded_generator(self.seed, rollout_step, weights=REPLAY_DRAW)
        chosen = torch.randperm(n_groups, generator=generator)[: self.groups].sort().values
        return pool.select(group_rows(chosen, group_size))

    def state_dict(self) -> list[dict]:
        return [batch.state_dict() for batch in self.batches]

    def load_state_dict(self, state: list[dict]) -> None:
        self.batches = deque(Batch(**batch) for batch in state)
