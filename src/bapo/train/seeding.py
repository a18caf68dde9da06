"""Seeded random streams: the draws of the loop that must repeat without saved state.

Each such draw (the mini-batch split of an update, the replay buffer's group draw, the warm start's
batches) takes a fresh CPU `torch.Generator` seeded from integer keys (run.seed, rollout step,
epoch, ...), so a resumed run redraws exactly what the uninterrupted run drew. The seed of a stream
is the weighted sum of its keys; each stream has its own weights (below), kept as they were when
the streams were introduced so that runs stay bit-identical across versions.
"""

from __future__ import annotations

import torch

#: weights of (run seed, rollout step, epoch): the row order an epoch splits into mini-batches
MINIBATCH_SPLIT = (7919, 101, 1)
#: weights of (run seed, rollout step): the groups a replay step draws from the buffer
REPLAY_DRAW = (1_000_003, 1)


def seeded_generator(*keys: int, weights: tuple[int, ...] = (1,)) -> torch.Generator:
    """A fresh CPU generator seeded with sum(weight * key) (one key and default weights: the key itself).

    It does not touch, and is not touched by, the global torch RNG.
    """
    if len(keys) != len(weights):
        raise ValueError(f"seeded_generator: {len(keys)} keys but {len(weights)} weights; pass one weight per key")
    return torch.Generator().manual_seed(sum(weight * int(key) for weight, key in zip(weights, keys)))
