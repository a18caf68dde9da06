"""Two gloo ranks with different shards (and micro-batch counts) get identical bounds, equal to
one process searching the concatenation, with exactly one all-reduce."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bapo.core import BAPOConfig, BoundStats, search_bounds

CFG = BAPOConfig(target=0.5, lower_step=0.05, upper_step=0.05)


def make_data():
    generator = torch.Generator().manual_seed(7)
    ratio = torch.exp(0.7 * torch.randn(10, 16, generator=generator))
    advantages = torch.randn(10, generator=generator) - 0.4  # negative-leaning: the search must move
    mask = torch.rand(10, 16, generator=generator) > 0.2
    return ratio, advantages, mask


def shard(rank, ratio, advantages, mask):
    """Rank 0 holds rows 0-2 in one micro-batch; rank 1 holds rows 3-9 in three micro-batches."""
    pieces = [slice(0, 3)] if rank == 0 else [slice(3, 5), slice(5, 6), slice(6, 10)]
    return [(ratio[p], advantages[p], mask[p]) for p in pieces]


def worker(rank, world_size, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        stats = BoundStats(CFG)
        for micro_batch in shard(rank, *make_data()):
            stats.add(*micro_batch)
        found = stats.solve()  # torch.distributed is initialised: sums over ranks
        results[rank] = (found, len(calls))
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()


def test_two_gloo_ranks_agree_with_the_concatenation(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(worker, args=(2, str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    whole = search_bounds(*make_data(), CFG)
    assert whole.steps > 0  # the case exercises the search
    (found0, calls0), (found1, calls1) = results[0], results[1]
    assert found0 == found1 == whole
    assert calls0 == calls1 == 1
    local_only = search_bounds(*shard(0, *make_data())[0], CFG)
    assert local_only != whole  # without the all-reduce rank 0 would have chosen differently
