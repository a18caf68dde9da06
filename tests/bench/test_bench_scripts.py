"""Every benchmark script runs at a small size and prints one parseable JSON object with `--json`,
so that a benchmark cannot rot unseen (issue 21: bench/trainer.py crashed on main for weeks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# the trainer benchmarks' smallest batch: 2 prompts x 4 responses of <= 8 tokens, one timed rollout
SMALL_BATCH = ["--prompts", "2", "--group", "4", "--new-tokens", "8", "--micro-batch", "4", "--rollouts", "1"]

# Small sizes per script, and the keys its JSON must carry. A new script without an entry fails
# test_every_bench_script_has_a_smoke_size, so it gets one.
SMALL_RUNS = {
    "bound_search.py": (["--tokens", "20000", "--repeats", "1"], ["machine", "rows"]),
    "checkpoint_save.py": (["--repeats", "1"], ["checkpoint_mb", "median_ms", "save_overhead"]),
    "real_model.py": (
        ["--tiny", *SMALL_BATCH, "--updates", "1", "--repeats", "1"],
        [
            "setup",
            "parts",
            "lean_vs_hf",
            "update_bf16_vs_fp32",
            "update_fp32_vs_trl",
            "update_shared_vs_padded",
            "update_fp32_flops_fraction",
            "skipped",
        ],
    ),
    "trainer.py": (
        [*SMALL_BATCH, "--repeats", "1"],
        ["setup", "systems", "rollout_vs_trl", "update_vs_trl", "bapo_step_overhead", "trl_bapo_step_overhead"],
    ),
}


def test_every_bench_script_has_a_smoke_size():
    scripts = {path.name for path in BENCH.glob("*.py") if path.name != "__init__.py"}
    assert scripts == set(SMALL_RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALL_RUNS))
def test_bench_script_runs_small_and_prints_json(script, tmp_path):
    args, keys = SMALL_RUNS[script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH.parents[0] / "src"), str(BENCH.parents[0]), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--json"], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(keys) <= set(result)
    numbers = [value for value in result.values() if isinstance(value, float)]
    assert all(value > 0 for value in numbers)


def test_update_model_flops_counts_each_groups_prompt_once_and_every_response_token():
    """PaLM's count by hand: two groups (prompts of 3 and 2 tokens) of two responses (lengths 2, 1 and
    1, 0): 5 prompt positions + 4 response positions, each 6 x matmul weights; attention 12 x layers x
    hidden x attended positions (prompt 1+2+3 and 1+2; responses 4+5, 4, 3, none)."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(BENCH.parents[0]))
    from bench.real_model import update_model_flops

    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(6, 3))
    model.config = SimpleNamespace(num_hidden_layers=2, hidden_size=4)
    batch = SimpleNamespace(
        example_idx=torch.tensor([7, 7, 9, 9]),
        prompt_mask=torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]], dtype=torch.bool),
        response_mask=torch.tensor([[1, 1], [1, 0], [1, 0], [0, 0]], dtype=torch.bool),
    )
    attended = (1 + 2 + 3) + (1 + 2) + (4 + 5) + 4 + 3
    assert update_model_flops(model, batch) == 6 * (24 + 18) * (5 + 4) + 12 * 2 * 4 * attended
