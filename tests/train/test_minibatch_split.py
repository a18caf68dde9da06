"""offpolicy.minibatch_split: each optimizer update trains whole prompt groups by default; the row
split stays available and repeats the old order exactly."""

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.train import ConfigError, load_config
from bapo.train.buffer import minibatch_order
from bapo.train.config_io import load_run_config
from bapo.train.rundir import check_resume_config
from bapo.train.seeding import MINIBATCH_SPLIT, seeded_generator


def old_row_order(rows, mini_batches, epochs, seed, step):
    """The row split as minibatch_order computed it before groups were kept whole (the reference)."""
    updates = []
    for epoch in range(epochs):
        generator = seeded_generator(seed, step, epoch, weights=MINIBATCH_SPLIT)
        order = torch.randperm(rows, generator=generator) if mini_batches > 1 else torch.arange(rows)
        updates += [(epoch, part.sort().values) for part in order.tensor_split(mini_batches)]
    return updates


# the keys of a split besides its sizes: epochs and the (seed, step) it is drawn from
SPLIT_KEYS = {"epochs": st.integers(1, 3), "seed": st.integers(0, 10_000), "step": st.integers(0, 10_000)}


@settings(max_examples=60, deadline=None)
@given(groups=st.integers(1, 12), group_size=st.integers(2, 6), mini_batches=st.integers(1, 12), **SPLIT_KEYS)
def test_every_update_holds_whole_groups_and_every_row_is_used_once_per_epoch(
    groups, group_size, mini_batches, epochs, seed, step
):
    rows = groups * group_size
    updates = minibatch_order(rows, mini_batches, epochs, seed, step, group_size)
    assert len(updates) == epochs * mini_batches
    assert [epoch for epoch, _ in updates] == [e for e in range(epochs) for _ in range(mini_batches)]
    for epoch in range(epochs):
        parts = [part for e, part in updates if e == epoch]
        assert sorted(torch.cat(parts).tolist()) == list(range(rows))  # a partition of the batch
        sizes = []
        for part in parts:
            assert part.tolist() == sorted(part.tolist())
            members = part.reshape(-1, group_size) if len(part) else part.reshape(0, group_size)
            # each part is whole groups: rows g*G .. g*G+G-1, in order
            assert torch.equal(members, members[:, :1] + torch.arange(group_size))
            assert bool((members[:, 0] % group_size == 0).all())
            sizes.append(len(members))
        assert max(sizes) - min(sizes) <= 1  # parts differ by at most one group
        assert sum(size == 0 for size in sizes) == max(mini_batches - groups, 0)  # empty only when too few groups


def test_the_split_is_a_function_of_seed_step_and_epoch():
    # resume redraws the split from (seed, step, epoch) alone: no state, nothing consumed from the global RNG
    torch.manual_seed(0)
    first = minibatch_order(40, 5, 2, 3, 7, group_size=8)
    torch.rand(100)
    again = minibatch_order(40, 5, 2, 3, 7, group_size=8)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, again))
    other_step = minibatch_order(40, 5, 2, 3, 8, group_size=8)
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(first, other_step))
    # the two epochs of one step shuffle differently (one group per part: 5! orders, a tie is 1/120)
    assert [p.tolist() for _, p in first[:5]] != [p.tolist() for _, p in first[5:]]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 60), mini_batches=st.integers(1, 8), **SPLIT_KEYS)
def test_the_row_split_repeats_the_old_order_exactly(rows, mini_batches, epochs, seed, step):
    # integer indices from the same generator: equality is exact, no float rounding involved
    new = minibatch_order(rows, mini_batches, epochs, seed, step)  # group_size 1 = offpolicy.minibatch_split=rows
    old = old_row_order(rows, mini_batches, epochs, seed, step)
    assert [(e, p.tolist()) for e, p in new] == [(e, p.tolist()) for e, p in old]


def test_rows_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match="not whole groups of 4"):
        minibatch_order(10, 2, 1, 0, 0, group_size=4)


def test_a_row_split_mixes_groups_which_the_group_split_never_does():
    # the reason for the default: with rows, some update holds part of a group (its advantages do not sum to 0)
    rows, group_size = 40, 8
    split_groups = False
    for step in range(20):
        for _, part in minibatch_order(rows, 5, 1, 0, step):
            counts = torch.bincount(part // group_size, minlength=rows // group_size)
            split_groups |= bool(((counts > 0) & (counts < group_size)).any())
    assert split_groups


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.prompts_per_batch=4", "offpolicy.mini_batches=5"], "offpolicy.mini_batches=5 is more than the 4"),
        (
            ["offpolicy.minibatch_split=rows", "offpolicy.mini_batches=3"],
            "offpolicy.mini_batches=3 must divide",
        ),
        (["offpolicy.minibatch_split=row"], "offpolicy.minibatch_split"),
    ],
)
def test_bad_split_config_names_the_field(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        load_config("examples/configs/bapo_math.yaml", overrides)
    assert "\n" not in str(err.value)


def test_groups_need_not_divide_evenly():
    cfg = load_config("examples/configs/bapo_math.yaml", ["rollout.prompts_per_batch=5", "offpolicy.mini_batches=3"])
    assert cfg.offpolicy.minibatch_split == "groups" and cfg.offpolicy.mini_batches == 3


def test_a_run_written_before_the_key_resumes_with_the_row_split(tmp_path):
    """A config.yaml without offpolicy.minibatch_split is a run that split rows: `bapo train --resume`
    keeps rows (config_io.upgrade_run_config, through load_run_config), and a resume that would switch
    it to groups is refused."""
    cfg = load_config("examples/configs/bapo_math.yaml", ["offpolicy.minibatch_split=rows"])
    old = cfg.model_dump(mode="json")
    del old["offpolicy"]["minibatch_split"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    resumed = load_run_config(tmp_path)
    assert resumed.offpolicy.minibatch_split == "rows"
    check_resume_config(tmp_path, resumed)  # the same run: accepted
    with pytest.raises(ConfigError, match="offpolicy.minibatch_split was 'rows' in this run, now 'groups'"):
        check_resume_config(tmp_path, load_config(str(tmp_path / "config.yaml")))
    assert load_run_config(tmp_path, ["offpolicy.minibatch_split=groups"]).offpolicy.minibatch_split == "groups"
    (tmp_path / "config.yaml").write_text(load_config("examples/configs/bapo_math.yaml").to_yaml())
    assert load_run_config(tmp_path).offpolicy.minibatch_split == "groups"  # a run that has the key keeps it
