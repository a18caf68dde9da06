import random

import pytest

from bapo.demo.task import (TaskConfig, demonstrations, format_prompt, make_split, parse_answer,
                            sample_problem, solve, verify, worked_solution)

ROW = {"prompt": "12+7-5=", "answer": "14"}


def test_worked_solution_is_correct_and_verifies():
    text, value = worked_solution([12, 7, 5], ["+", "-"])
    assert text == "12+7=19\n19-5=14\nanswer:14"
    assert value == solve([12, 7, 5], ["+", "-"]) == 14
    assert verify(text, ROW) == 1.0


@pytest.mark.parametrize("response", [
    "12+7=19\n19-5=13\nanswer:13",      # a slipped step, propagated
    "answer:15",                        # wrong, no work shown
    "12+7=19\n19-5=14\nanswer:-14",
])
def test_wrong_answers_get_zero(response):
    assert parse_answer(response) is not None
    assert verify(response, ROW) == 0.0


@pytest.mark.parametrize("response", [
    "", "14", "12+7=19\n19-5=14", "answer:", "answer:14\nanswer:14", "answer:14x",
    "12+7=19 blah\nanswer:14", "12+7=19\n19-5=14\nanswer:14\n12", "answer: fourteen",
])
def test_malformed_outputs_get_zero(response):
    assert parse_answer(response) is None
    assert verify(response, ROW) == 0.0


def test_answer_alone_is_well_formed():
    assert verify("answer:14", ROW) == 1.0 and verify(" answer:14 \n", ROW) == 1.0


def test_negative_intermediates_parse():
    text, value = worked_solution([3, 9, 2], ["-", "+"])
    assert value == -4 and verify(text, {"answer": "-4"}) == 1.0


def test_difficulty_sets_terms_and_range():
    rng = random.Random(0)
    for d in (1, 2, 4):
        cfg = TaskConfig(difficulty=d)
        terms, ops = sample_problem(rng, cfg)
        assert len(terms) == d + 1 and len(ops) == d
        assert all(1 <= t <= cfg.max_operand for t in terms)
        assert format_prompt(terms, ops).count("=") == 1


def test_heldout_split_is_fixed_and_disjoint():
    a_train, a_held = make_split(TaskConfig(n_train=500, n_heldout=64))
    b_train, b_held = make_split(TaskConfig(n_train=300, n_heldout=64, train_seed=7))
    assert a_held == b_held                        # depends only on its own seed
    assert len({r["prompt"] for r in a_held}) == 64
    assert not {r["prompt"] for r in a_train} & {r["prompt"] for r in a_held}
    assert a_train != b_train
    assert all(verify(r["solution"], r) == 1.0 for r in a_train + a_held)


def test_demonstrations_slip_at_about_the_rate():
    rows, _ = make_split(TaskConfig(n_train=1000, n_heldout=8))
    clean = demonstrations(rows, 0.0, seed=0)
    slipped = demonstrations(rows, 0.25, seed=0)
    wrong = sum(verify(t[len(r["prompt"]):], r) == 0.0 for t, r in zip(slipped, rows))
    assert all(verify(t[len(r["prompt"]):], r) == 1.0 for t, r in zip(clean, rows))
    # difficulty 2 has two steps: P(some slip) = 1 - 0.75^2 = 0.44 (a slip can cancel rarely)
    assert 0.35 < wrong / len(rows) < 0.52
    assert all(parse_answer(t[len(r["prompt"]):]) is not None for t, r in zip(slipped, rows))


def test_too_small_task_space_fails_loudly():
    with pytest.raises(ValueError, match="too few distinct"):
        make_split(TaskConfig(difficulty=1, n_train=1000, n_heldout=8))
