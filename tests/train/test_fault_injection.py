"""Fault injection on real `bapo train` processes (the demo's model and task): SIGKILLs at random
moments, including inside checkpoint saves (one per rollout step), a SIGTERM, and a corrupted
newest checkpoint; the run, resumed after each, must end bit-exactly where an uninterrupted run
ends (same metrics rows, same weights)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bapo.train import load_config, read_metrics, train
from bapo.train.checkpoint import checkpoints, latest_checkpoint
from tests.train.test_resume import strip_timing

SRC = Path(__file__).parents[2] / "src"
ROLLOUT_STEPS = 8
KILL_SEED = 20261202  # fixed so CI is reproducible; the kill points differ per launch


@pytest.fixture(scope="module")
def demo_setup(tmp_path_factory):
    """The demo's random-init Llama and char tokenizer, its arithmetic prompts, a config."""
    from bapo.experiments.task import TaskConfig, make_split
    from bapo.train.tiny import ModelConfig, build_model, build_tokenizer

    root = tmp_path_factory.mktemp("fault")
    tokenizer = build_tokenizer()
    build_model(ModelConfig(), tokenizer).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    train_rows, _ = make_split(TaskConfig())
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in train_rows[:64]))

    def config(run_dir: Path) -> Path:
        cfg = {
            "model": {"path": str(root / "model"), "device": "cpu"},
            "data": {"path": str(data)},
            "rollout": {"prompts_per_batch": 4, "group_size": 4, "max_new_tokens": 8, "segment_tokens": 4},
            "reward": {"verifier": "format", "format_pattern": "[0-4]"},  # dense, so weights move
            "loss": {"method": "bapo"},
            "optim": {"lr": 1e-3},
            "offpolicy": {"async_delay": 1, "mini_batches": 2},
            "run": {
                "output_dir": str(run_dir),
                "rollout_steps": ROLLOUT_STEPS,
                "checkpoint_every": 1,
                "keep_checkpoints": 2,
                "save_optimizer": "all",
                "progress": False,
                "tensorboard": "off",
            },
        }
        path = run_dir.parent / f"{run_dir.name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    return config


def launch(config: Path, run_dir: Path) -> subprocess.Popen:
    args = ["--resume", str(run_dir)] if (run_dir / "config.yaml").exists() else [str(config)]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    return subprocess.Popen(
        [sys.executable, "-m", "bapo.cli.main", "train", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rows_written(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def interrupt(proc: subprocess.Popen, run_dir: Path, after_rows: int, delay_s: float, sig: int) -> tuple[int, str]:
    """Send `sig` `delay_s` after the run has written `after_rows` metrics rows (or when it ends)."""
    while proc.poll() is None and rows_written(run_dir) < after_rows:
        time.sleep(0.02)
    time.sleep(delay_s)
    if proc.poll() is None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def kill_inside_a_save(proc: subprocess.Popen, run_dir: Path) -> tuple[int, bool]:
    """SIGKILL as soon as a checkpoint's temporary directory appears; True if it was still there."""
    root = run_dir / "checkpoints"
    while proc.poll() is None and not any(root.glob(".tmp_update_*")):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    return proc.returncode, any(root.glob(".tmp_update_*"))


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")


def test_killed_interrupted_and_corrupted_runs_resume_bit_exactly(demo_setup, tmp_path):
    straight = tmp_path / "straight"
    train(load_config(demo_setup(straight)))  # the reference, uninterrupted (in-process: one launch less)
    updates = ROLLOUT_STEPS * 2

    run_dir = tmp_path / "faulty"
    config = demo_setup(run_dir)
    rng = random.Random(KILL_SEED)
    code, mid_save = kill_inside_a_save(launch(config, run_dir), run_dir)
    events = [("kill in save", code, mid_save)]
    # then SIGKILLs at random points (mid-update, mid-rollout, at start-up: wherever they land)
    for _ in range(2):
        code, err = interrupt(
            launch(config, run_dir), run_dir, rng.randrange(1, updates - 2), rng.uniform(0, 0.4), signal.SIGKILL
        )
        events.append(("kill", code, rows_written(run_dir)))
        assert code in (-signal.SIGKILL, 0), err
    # a SIGTERM: the step finishes, a checkpoint is written, exit 143 with the resume command
    code, err = interrupt(launch(config, run_dir), run_dir, rows_written(run_dir) + 1, 0.0, signal.SIGTERM)
    if code != 0:
        assert code == 143, err
        assert f"resume with: bapo train --resume {run_dir}" in err
    # the newest checkpoint corrupted on disk: resume warns and falls back to the one before
    newest = checkpoints(run_dir)[0]
    weights = newest / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    proc = launch(config, run_dir)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"{newest.name} is not usable" in err and "sha256" in err

    assert strip_timing(read_metrics(run_dir)) == strip_timing(read_metrics(straight)), events
    ours, reference = final_weights(run_dir), final_weights(straight)
    assert ours.keys() == reference.keys()
    assert all(ours[k].equal(reference[k]) for k in ours)
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))
