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
