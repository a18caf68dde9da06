"""examples/minimal.py runs a few updates on a quickly warm-started tiny model, and what it prints
is what the algorithm promises: finite losses, a FIFO whose data is exactly k updates old (seen in
the token ratio, not only in the printed counter), and bapo bounds that obey Algorithm 1's stop rule."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal.py"
SMALL_RUN = ["--prompts", "8", "--group-size", "8", "--lr", "1e-3"]  # the task's own response budget


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("minimal_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> str:
    """~10 s of SFT on the demo task: a 2-layer model that answers about 10% of prompts right
    (1 layer and 2 heads stayed near 0% after 800 steps: the task needs copying and arithmetic),
    so that groups have reward variance and the losses see non-zero advantages."""
    import torch

    from bapo.experiments.task import TaskConfig
    from bapo.experiments.warmstart import ModelConfig, SFTConfig, WarmStartConfig, warm_start

    torch.set_num_threads(1)
    cfg = WarmStartConfig(
        task=TaskConfig(n_train=500, n_heldout=8),
        model=ModelConfig(hidden_size=64, layers=2, heads=4, intermediate_size=128),
        sft=SFTConfig(steps=300, batch_size=32, lr=5e-3, warmup=5),
    )
    return str(warm_start(cfg, root=tmp_path_factory.mktemp("warmstart"), eval_k=1))


def printed_rows(text: str) -> list[dict[str, float]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("update="):
            rows.append({key: float(value) for key, value in (pair.split("=") for pair in line.split())})
    return rows


def test_bapo_with_async_delay_trains_on_exactly_k_updates_old_data(example, tiny_policy, capsys):
    async_delay, updates = 2, 5
    history = example.main(
        ["bapo", "--async-delay", str(async_delay), "--updates", str(updates), "--model", tiny_policy, *SMALL_RUN]
    )
    rows = printed_rows(capsys.readouterr().out)
    assert len(rows) == updates == len(history)
    assert [row["loss"] for row in rows] == pytest.approx([row["loss"] for row in history], rel=1e-3, abs=1e-6)
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in rows)
    # warm-up batches all come from the initial policy; from update k on the data is k updates old
    assert [row["data_version"] for row in history] == [max(u - async_delay, 0) for u in range(updates)]
    assert [row["policy_lag"] for row in history] == [min(u, async_delay) for u in range(updates)]
    # update 0 trains on its own policy's samples (ratio exactly 1); every later one on older weights
    assert history[0]["ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert all(abs(row["ratio/max"] - 1.0) > 1e-6 for row in history[1:])
    assert sum(row["reward"] > 0 for row in history) >= 2, "the tiny policy should solve some prompts"
    for row in history:  # Algorithm 1 stops when the share reaches the target or the lower bound is exhausted
        assert 0.6 <= row["lower"] <= 0.9 and 1.2 <= row["upper"] <= 3.0
        if math.isnan(row["positive_share"]):  # no token carries a non-zero advantage: nothing to balance
            assert (row["lower"], row["upper"]) == (0.6, 1.2), row
            continue
        exhausted = row["upper"] == pytest.approx(3.0) and row["lower"] + 0.02 > 0.9 + 1e-9
        assert row["positive_share"] >= 0.5 - 1e-6 or exhausted, row
    assert any(row["upper"] > 1.2 or row["lower"] > 0.6 for row in history), "bapo never moved its bounds"


def test_grpo_on_policy_keeps_fixed_bounds_and_ratio_one(example, tiny_policy, capsys):
    history = example.main(["grpo", "--async-delay", "0", "--updates", "3", "--model", tiny_policy, *SMALL_RUN])
    assert "lower=0.8 upper=1.2" in capsys.readouterr().out
    for row in history:
        assert row["policy_lag"] == 0 and row["data_version"] == row["update"]
        assert row["ratio/max"] == pytest.approx(1.0, abs=1e-5)  # fresh data: nothing can be clipped
        assert row["clip_frac/upper"] == row["clip_frac/lower"] == 0.0
        assert math.isfinite(row["loss"])


def test_the_old_staleness_flag_is_refused_naming_async_delay_and_E(example, capsys):
    """--staleness was k; a reader of the paper means E by it, so it is refused, never reinterpreted."""
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(["bapo", "--staleness", "2"])
    assert exit_info.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(error) == 1 and "--staleness was renamed --async-delay" in error[0]
    assert "staleness E" in error[0] and "offpolicy.mini_batches" in error[0]
    assert example.parse_args(["bapo", "--async-delay", "3"]).async_delay == 3
