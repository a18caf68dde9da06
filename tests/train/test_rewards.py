import time

import pytest

from bapo.train import extract_answer, resolve_verifier
from bapo.train.rewards import score


def test_builtin_verifiers():
    exact, math, fmt = resolve_verifier("exact"), resolve_verifier("math"), resolve_verifier("format")
    assert exact(" 42\n", {"answer": "42"}) == 1.0 and exact("41", {"answer": "42"}) == 0.0
    assert math("so the answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert math("first 3, then 7 apples", {"answer": "7"}) == 1.0   # last number
    assert math("first 7, then 3 apples", {"answer": "7"}) == 0.0
    assert math("no number here", {"answer": "7"}) == 0.0
    assert fmt("x \\boxed{3}", {}) == 1.0 and fmt("3", {}) == 0.0
    assert resolve_verifier("format", format_pattern=r"^\d+$")("123", {}) == 1.0


def test_extract_answer_prefers_last_boxed():
    assert extract_answer("\\boxed{1} then \\boxed{x^{2}} and 5") == "x^{2}"
    assert extract_answer("total 1,234 items") == "1234"
    assert extract_answer("nothing") is None


def test_import_path_and_bad_names():
    fn = resolve_verifier("bapo.train.rewards:exact_match")
    assert fn("a", {"answer": "a"}) == 1.0
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_verifier("bapo.train.rewards:nope")
    with pytest.raises(ValueError, match="use one of"):
        resolve_verifier("exactly")


def test_raising_slow_and_nonfinite_verifiers_give_zero_and_are_counted():
    def flaky(response, example):
        if response == "boom":
            raise RuntimeError("bug in verifier")
        if response == "slow":
            time.sleep(3)
        if response == "nan":
            return float("nan")
        return 1.0

    start = time.perf_counter()
    rewards, failures = score(flaky, ["ok", "boom", "slow", "nan", "ok"], [{}] * 5, timeout_s=0.3)
    assert time.perf_counter() - start < 2.0  # the slow one was abandoned, not waited for
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert failures == 3
