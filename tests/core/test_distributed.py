"""Two gloo ranks with different shards (and micro-batch counts) get identical bounds, equal to
one process searching the concatenation, with exactly one all-reduce, under each definition of
the positive share (gradient, paper Eq. 8, recipe)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bapo.core import BAPOConfig, BoundStats, TokenBatch, search_bounds

CONFIGS = {
    "gradient": BAPOConfig(target=0.5, lower_step=0.05, upper_step=0.05),
    "paper": BAPOConfig.paper(target=0.5),
    "recipe": BAPOConfig.recipe(target=1.5),
}


def make_data() -> TokenBatch:
    generator = torch.Generator().manual_seed(7)
    ratio = torch.exp(0.7 * torch.randn(10, 16, generator=generator))
    advantages = torch.randn(10, generator=generator) - 0.4  # negative-leaning: the search must move
    mask = torch.rand(10, 16, generator=generator) > 0.2
    old_log_prob = -2 * torch.rand(10, 16, generator=generator)
    return TokenBatch(ratio=ratio, advantages=advantages, mask=mask, old_log_prob=old_log_prob)


def shard(rank, batch: TokenBatch) -> list[TokenBatch]:
    """Rank 0 holds rows 0-2 in one micro-batch; rank 1 holds rows 3-9 in three micro-batches."""
    pieces = [slice(0, 3)] if rank == 0 else [slice(3, 5), slice(5, 6), slice(6, 10)]
    return [
        TokenBatch(
            ratio=batch.ratio[p], advantages=batch.advantages[p], mask=batch.mask[p], old_log_prob=batch.old_log_prob[p]
        )
        for p in pieces
    ]


def worker(rank, world_size, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        found = {}
        for name, cfg in CONFIGS.items():
            calls.clear()
            stats = BoundStats(cfg)
            for micro_batch in shard(rank, make_data()):
                stats.add(micro_batch)
            found[name] = (stats.solve(), len(calls))  # torch.distributed is initialised: sums over ranks
        results[rank] = found
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()


def test_two_gloo_ranks_agree_with_the_concatenation(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(worker, args=(2, str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    for name, cfg in CONFIGS.items():
        whole = search_bounds(make_data(), cfg)
        assert whole.steps > 0, name  # the case exercises the search
        (found0, calls0), (found1, calls1) = results[0][name], results[1][name]
        assert found0 == found1  # bit-identical on both ranks
        assert (found0.lower, found0.upper, found0.steps) == (whole.lower, whole.upper, whole.steps), name
        assert abs(found0.positive_share - whole.positive_share) < 1e-12
        assert calls0 == calls1 == 1
        local_only = search_bounds(shard(0, make_data())[0], cfg)
        # without the all-reduce rank 0 would have seen another share (and mostly other bounds)
        assert (local_only.lower, local_only.upper, local_only.positive_share) != (
            whole.lower,
            whole.upper,
            whole.positive_share,
        ), name
