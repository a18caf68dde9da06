"""Checkpoints: exact resume, atomic writes, non-finite stop."""

import random

import numpy as np
import pytest
import torch

from bapo.train import Trainer, TrainingStopped, read_metrics, train
from bapo.train.checkpoint import latest_checkpoint
from bapo.train.metrics import is_timing
from tests.helpers import arithmetic_examples, digit_share, make_config


def strip_timing(rows):
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in rows]


@pytest.mark.parametrize(
    "extra",
    [
        {"offpolicy.async_delay": 2},
        {
            "offpolicy.async_delay": 1,
            "rollout.segment_tokens": 3,
            "loss.method": "bapo",
            "optim.micro_batch_size": 6,
            "offpolicy.mini_batches": 2,
            "optim.schedule": "cosine",
            "optim.warmup_updates": 2,
        },
        {"offpolicy.mode": "replay", "offpolicy.replay_batches": 2},
    ],
    ids=["fifo", "partial-bapo-minibatch", "replay"],
)
def test_resume_is_exact(tiny_model, tmp_path, extra):
    check_resume_is_exact(tiny_model, tmp_path, extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resume_is_exact_on_cuda(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    check_resume_is_exact(
        tiny_model,
        tmp_path,
        {
            "model.device": "cuda",
            "run.deterministic": True,
            "offpolicy.async_delay": 1,
            "loss.method": "bapo",
            "optim.micro_batch_size": 6,
        },
    )


def test_resume_is_exact_for_dcpo(tiny_model, tmp_path):
    """DCPO's per-prompt reward history is part of the checkpoint: 5 prompts, 4 per step, so the
    prompts of steps 4-6 all have history from before the checkpoint."""
    check_resume_is_exact(tiny_model, tmp_path, {"loss.method": "dcpo"}, examples=arithmetic_examples(5))


def check_resume_is_exact(tiny_model, tmp_path, extra, examples=None):
    data = dict(examples=examples or arithmetic_examples(), verifier=digit_share)
    straight = make_config(tiny_model, tmp_path / "straight", **{"run.rollout_steps": 6, **extra})
    rows_straight = read_metrics(train(straight, **data))

    # a first run of 3 steps that means to run 6: same schedule, checkpoint at step 3, then "killed"
    split = make_config(tiny_model, tmp_path / "split", **{"run.rollout_steps": 6, "run.checkpoint_every": 3, **extra})
    trainer = Trainer(split.model_copy(deep=True), **data)
    trainer.cfg.run.rollout_steps = 3
    trainer.fit()
    torch.manual_seed(12345)  # a new process would start from other RNG states
    random.seed(12345)
    np.random.seed(12345)
    # rows past the checkpoint (written before a kill) must be dropped on resume
    with open(tmp_path / "split" / "metrics.jsonl", "a") as f:
        f.write('{"update": 99, "reward/mean": 0}\n')
    rows_split = read_metrics(train(split, resume=tmp_path / "split", **data))
    assert len(rows_straight) == 6 * split.updates_per_batch
    assert strip_timing(rows_split) == strip_timing(rows_straight)


def test_checkpoint_is_atomic_and_pruned(tiny_model, tmp_path):
    cfg = make_config(
        tiny_model, tmp_path / "run", **{"run.rollout_steps": 4, "run.checkpoint_every": 1, "run.keep_checkpoints": 2}
    )
    run_dir = train(cfg, examples=arithmetic_examples(), verifier=digit_share)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("update_*")) == ["update_000003", "update_000004"]
    assert latest_checkpoint(run_dir).name == "update_000004"
    # a half-written checkpoint (killed mid-save) and a dangling pointer do not hide the good one
    (root / ".tmp_update_000005_123" / "model").mkdir(parents=True)
    (root / "latest").write_text("update_000005")
    assert latest_checkpoint(run_dir).name == "update_000004"
    # starting afresh over an existing run needs overwrite
    with pytest.raises(Exception, match="already holds a run"):
        Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)


def test_nonfinite_updates_are_skipped_then_training_stops(tiny_model, tmp_path, monkeypatch):
    import bapo.train.update as update

    real = update.policy_loss

    def broken(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), {**metrics, "loss": float("nan")}

    monkeypatch.setattr(update, "policy_loss", broken)
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 10, "run.max_nonfinite": 3})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(TrainingStopped, match="3 updates in a row had a non-finite"):
        trainer.fit()
    rows = read_metrics(tmp_path / "run")
    assert [r["skipped"] for r in rows] == [1, 1, 1]
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # no bad step applied
    assert latest_checkpoint(tmp_path / "run").name == "update_000003"
