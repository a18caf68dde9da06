import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bapo.train import extract_answer, resolve_verifier
from bapo.train.rewards import score


def test_builtin_verifiers():
    exact, math, fmt = resolve_verifier("exact"), resolve_verifier("math"), resolve_verifier("format")
    assert exact(" 42\n", {"answer": "42"}) == 1.0 and exact("41", {"answer": "42"}) == 0.0
    assert math("so the answer is \\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert math("first 3, then 7 apples", {"answer": "7"}) == 1.0  # last number
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


def test_a_verifier_under_the_renamed_bapo_demo_is_refused_naming_its_new_path():
    # runs written before the move name bapo.demo.*: one line with the replacement, and the new
    # path it names is a verifier that exists
    with pytest.raises(ValueError, match=r"bapo\.demo is now bapo\.experiments: use 'bapo\.experiments\.arith:verify'"):
        resolve_verifier("bapo.demo.arith:verify")
    assert callable(resolve_verifier("bapo.experiments.arith:verify"))
    assert callable(resolve_verifier("bapo.experiments.task:verify"))


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


def test_verifier_exits_interrupts_and_non_numbers_are_failures():
    def hostile(response, example):
        if response == "exit":
            raise SystemExit(3)
        if response == "interrupt":
            raise KeyboardInterrupt
        if response == "huge":
            return 1e39  # finite in Python, inf in float32
        if response == "string":
            return "1.0"
        if response == "none":
            return None
        return 0.5

    rewards, failures = score(hostile, ["exit", "interrupt", "huge", "string", "none", "ok"], [{}] * 6, timeout_s=5)
    assert rewards.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.5]
    assert failures == 5


def test_score_uses_a_bounded_number_of_threads():
    import threading

    from bapo.train.rewards import MAX_WORKERS

    seen = []

    def counting(response, example):
        seen.append(threading.active_count())
        time.sleep(0.002)
        return 1.0

    base = threading.active_count()
    rewards, failures = score(counting, ["x"] * 200, [{}] * 200, timeout_s=5)
    assert failures == 0 and rewards.sum() == 200
    assert max(seen) <= base + MAX_WORKERS


def test_each_call_gets_its_own_timeout_and_hung_ones_are_replaced():
    def slow_then_fast(response, example):
        if response == "hang":
            time.sleep(30)
        time.sleep(0.05)
        return 1.0

    responses = ["hang"] * 2 + ["ok"] * 6
    rewards, failures = score(slow_then_fast, responses, [{}] * 8, timeout_s=0.5, workers=2)
    assert failures == 2 and rewards.tolist() == [0.0, 0.0] + [1.0] * 6


def test_a_verifier_that_never_returns_does_not_block_exit(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import threading\n"
        "from bapo.train.rewards import score\n"
        "rewards, failures = score(lambda r, e: threading.Event().wait(), ['a', 'b'], [{}, {}], timeout_s=0.2)\n"
        "print('failures', failures)\n"
    )
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")},
    )
    assert out.returncode == 0, out.stderr
    assert "failures 2" in out.stdout
    assert time.perf_counter() - start < 50
