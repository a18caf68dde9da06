import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.experiments.task import (
    TaskConfig,
    candidates,
    demonstrations,
    evaluate_attempt,
    format_prompt,
    make_split,
    parse_prompt,
    sample_problem,
    verify,
    worked_solution,
)

ROW = {"prompt": "7,12,5>17:", "answer": "12+5"}


def test_prompt_round_trips():
    assert format_prompt([7, 12, 5], 17) == ROW["prompt"]
    assert parse_prompt(ROW["prompt"]) == ([7, 12, 5], 17)
    with pytest.raises(ValueError, match="not a task prompt"):
        parse_prompt("7+12=")


@pytest.mark.parametrize(
    "response",
    [
        "12+5=17",
        "12-7=5\n7+12=19\n12+5=17",
        "5+12=17",
        " 7+5=12\n12+5=17 \n",
    ],
)
def test_hits_verify(response):
    assert verify(response, ROW) == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "",
        "12-7=5\n7+12=19",  # ran out of budget without a hit
        "12-7=5\n7+12=1",  # cut off mid-line by the budget
        "12+5=18",  # wrong arithmetic
        "10+7=17",  # 10 is not a prompt number
        "12+12=24\n12+5=17",  # 12 used twice (only one 12 in the prompt)
        "5-12=-7\n12+5=17",  # "-" must be larger minus smaller
        "12+5=17\n7+5=12",  # kept going after the hit
        "17",
        "12+5=17x",
        "answer:17",
    ],
)
def test_misses_get_zero(response):
    assert verify(response, ROW) == 0.0


def test_a_repeated_number_may_be_used_once_per_copy():
    assert verify("4+4=8", {"prompt": "4,4,1>8:"}) == 1.0


def test_problems_have_exactly_one_hitting_attempt():
    rng, cfg = random.Random(0), TaskConfig()
    for _ in range(200):
        numbers, target = sample_problem(rng, cfg)
        assert len(numbers) == cfg.n_numbers and all(1 <= n <= cfg.max_number for n in numbers)
        assert [evaluate_attempt(c) for c in candidates(numbers)].count(target) == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000))
def test_demonstrations_verify_and_stop_at_the_hit(seed):
    numbers, target = sample_problem(random.Random(seed), TaskConfig())
    row = {"prompt": format_prompt(numbers, target)}
    text = worked_solution(numbers, target, random.Random(seed))
    lines = text.split("\n")
    assert verify(text, row) == 1.0
    assert [int(line.split("=")[1]) == target for line in lines].count(True) == 1  # only the last line hits
    assert 1 <= len(lines) <= len(candidates(numbers))


def test_demonstrations_order_attempts_at_random():
    rows, _ = make_split(TaskConfig(n_train=400, n_heldout=8))
    texts = demonstrations(rows, seed=0)
    attempts = [len(t[len(r["prompt"]) :].split("\n")) for t, r in zip(texts, rows)]
    # a random order of 6 candidates puts the hit at position 1..6 uniformly: mean 3.5
    assert 3.2 < sum(attempts) / len(attempts) < 3.8
    assert demonstrations(rows, seed=0) == texts and demonstrations(rows, seed=1) != texts


def test_heldout_split_is_fixed_and_disjoint():
    a_train, a_held = make_split(TaskConfig(n_train=500, n_heldout=64))
    b_train, b_held = make_split(TaskConfig(n_train=300, n_heldout=64, train_seed=7))
    assert a_held == b_held  # depends only on its own seed
    assert len({r["prompt"] for r in a_held}) == 64
    assert not {r["prompt"] for r in a_train} & {r["prompt"] for r in a_held}
    assert a_train != b_train
    assert all(verify(r["answer"] + "=" + str(parse_prompt(r["prompt"])[1]), r) == 1.0 for r in a_train + a_held)


def test_too_small_task_space_fails_loudly():
    with pytest.raises(ValueError, match="too few distinct"):
        make_split(TaskConfig(max_number=3, n_train=1000, n_heldout=8))


def test_the_full_demo_profile_runs_every_peer_bapo_train_supports():
    """`bapo demo --full` names every registered loss (the peers included) in every setting; not run here."""
    from bapo.core import POLICY_LOSSES
    from bapo.experiments.demo import PEERS, plan_for, train_config

    runs = plan_for("full").runs()
    assert set(PEERS) == set(POLICY_LOSSES) - {"grpo", "clip-higher", "dual-clip", "topr", "dcpo", "bapo"}
    assert {run.method for run in runs} == set(POLICY_LOSSES)
    for peer in PEERS:  # at every E, the async delay and the partial rollout (a peer is not a shared E=0 run)
        settings = {run.setting for run in runs if run.method == peer}
        assert settings == {"E=0", "E=2", "E=4", "E=7", "E=0, async delay 4", "E=0, partial rollout"}, peer
    for run in runs:  # the config `bapo train` gets for each run validates
        assert (
            train_config(plan_for("full"), run, Path("model"), Path("train.jsonl"), Path("out")).loss.method
            == run.method
        )
    assert {run.method for run in plan_for("default").runs()} == {"grpo", "clip-higher", "dual-clip", "bapo"}
