"""Checkpoints that prove themselves: manifest, fallback on corruption, stale temporaries, disk
full, a kill during the first save, reruns and resumes that would change the run."""

import errno
import shutil
import warnings

import pytest
import torch

from bapo.train import ConfigError, Trainer, TrainingStopped, train
from bapo.train.checkpoint import (
    checkpoints,
    latest_checkpoint,
    load_state,
    verify_checkpoint,
)
from tests.helpers import arithmetic_examples, digit_share, make_config

DATA = {"examples": arithmetic_examples(), "verifier": digit_share}


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory):
    """A 2-step run with a checkpoint after each step, optimizer state in both."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    cfg = make_config(
        tiny_model, run_dir, **{"run.rollout_steps": 2, "run.checkpoint_every": 1, "run.save_optimizer": "all"}
    )
    train(cfg, **DATA)
    return cfg, run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    cfg, run_dir = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"output_dir": str(copy)})}, deep=True), copy


def resumed_version(cfg, run_dir) -> int:
    trainer = Trainer(cfg, resume=run_dir, **DATA)
    trainer.close()
    return trainer.version


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped-byte-weights": lambda c: flip_byte(c / "model" / "model.safetensors"),
    "flipped-byte-state": lambda c: flip_byte(c / "state.pt"),
    "truncated-safetensors": lambda c: (c / "model" / "model.safetensors").write_bytes(
        (c / "model" / "model.safetensors").read_bytes()[:1000]
    ),
    "missing-config": lambda c: (c / "model" / "config.json").unlink(),
    "missing-tokenizer": lambda c: (c / "model" / "tokenizer.json").unlink(),
    "empty-state": lambda c: (c / "state.pt").write_bytes(b""),
    "missing-manifest": lambda c: (c / "manifest.json").unlink(),
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_corrupted_newest_checkpoint_falls_back_with_a_warning(run_copy, corrupt):
    cfg, run_dir = run_copy
    newest, older = checkpoints(run_dir)
    assert verify_checkpoint(newest) is None
    CORRUPTIONS[corrupt](newest)
    assert verify_checkpoint(newest) is not None
    with pytest.warns(UserWarning, match="update_000002 is not usable") as caught:
        assert resumed_version(cfg, run_dir) == 1
    assert any(str(newest) in str(w.message) for w in caught)  # names the file's checkpoint
    assert checkpoints(run_dir) == [older]  # the bad one is renamed aside, not deleted
    assert (run_dir / "checkpoints" / "corrupt_update_000002").is_dir()


def test_no_checkpoint_verifies_fails_with_one_line(run_copy):
    cfg, run_dir = run_copy
    for checkpoint in checkpoints(run_dir):
        flip_byte(checkpoint / "state.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="none of its 2 checkpoints verifies") as err:
            resumed_version(cfg, run_dir)
    assert "\n" not in str(err.value)


def test_stale_temporaries_are_removed_at_start(run_copy):
    cfg, run_dir = run_copy
    stale = run_dir / "checkpoints" / ".tmp_update_000003_4242" / "model"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    assert resumed_version(cfg, run_dir) == 2
    assert not stale.parent.exists()


def test_disk_full_names_the_last_good_checkpoint_and_keeps_it(tiny_model, tmp_path, monkeypatch):
    from bapo.train import checkpoint

    real_save, calls = torch.save, []

    def save_until_disk_full(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save_until_disk_full)
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 3, "run.checkpoint_every": 1})
    with pytest.raises(
        TrainingStopped,
        match="no space left on device while writing checkpoint 2 .*the last good checkpoint is update_000001",
    ):
        train(cfg, **DATA)
    root = tmp_path / "run" / "checkpoints"
    assert not list(root.glob(".tmp_*"))  # the partial save is cleaned up
    assert latest_checkpoint(tmp_path / "run").name == "update_000001"
    assert load_state(root / "update_000001")["version"] == 1


def test_kill_during_first_save_then_resume_starts_over(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 2})
    run_dir = tmp_path / "run"
    # what a kill inside the first save leaves: config, metrics rows, a half-written temporary
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    (run_dir / "metrics.jsonl").write_text('{"update": 1}\n')
    (run_dir / "checkpoints" / ".tmp_update_000002_999" / "model").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already holds a run"):  # a fresh start refuses ...
        Trainer(cfg, **DATA)
    with pytest.warns(UserWarning, match="no checkpoint was completed yet"):  # ... so resume must work
        train(cfg, resume=run_dir, **DATA)
    assert latest_checkpoint(run_dir).name == "update_000002"
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))


def test_rerun_over_metrics_without_checkpoint_needs_overwrite(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"update": 1, "reward/mean": 0.5}\n')
    cfg = make_config(tiny_model, run_dir, **{"run.rollout_steps": 1})
    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer(cfg, **DATA)
    assert (run_dir / "metrics.jsonl").read_text() == '{"update": 1, "reward/mean": 0.5}\n'
    Trainer(make_config(tiny_model, run_dir, **{"run.rollout_steps": 1, "run.overwrite": True}), **DATA).close()


def test_deleted_metrics_warn_on_resume(run_copy):
    cfg, run_dir = run_copy
    (run_dir / "metrics.jsonl").unlink()
    with pytest.warns(UserWarning, match="metrics.jsonl is missing"):
        resumed_version(cfg, run_dir)


@pytest.mark.parametrize(
    "field,value",
    [
        ("offpolicy.async_delay", 1),
        ("offpolicy.mode", "replay"),
        ("rollout.group_size", 8),
        ("rollout.prompts_per_batch", 2),
        ("loss.method", "bapo"),
        ("optim.lr", 0.1),
    ],
)
def test_resume_refuses_overrides_that_change_the_run(run_copy, field, value):
    cfg, run_dir = run_copy
    changed = make_config(
        cfg.model.path,
        run_dir,
        **{"run.rollout_steps": 2, "run.checkpoint_every": 1, "run.save_optimizer": "all", field: value},
    )
    with pytest.raises(ConfigError, match=f"{field} was .* now"):
        resumed_version(changed, run_dir)


def test_resume_accepts_more_steps_and_records_them(run_copy):
    cfg, run_dir = run_copy
    longer = make_config(
        cfg.model.path,
        run_dir,
        **{"run.rollout_steps": 5, "run.checkpoint_every": 2, "run.save_optimizer": "all", "run.progress": True},
    )
    assert resumed_version(longer, run_dir) == 2
    assert "rollout_steps: 5" in (run_dir / "config.yaml").read_text()


def test_save_optimizer_latest_keeps_it_only_in_the_newest(tiny_model, tmp_path):
    cfg = make_config(
        tiny_model, tmp_path / "run", **{"run.rollout_steps": 3, "run.checkpoint_every": 1, "run.keep_checkpoints": 3}
    )
    run_dir = train(cfg, **DATA)
    newest, *older = checkpoints(run_dir)
    assert load_state(newest)["optimizer"] is not None
    assert [load_state(c)["optimizer"] for c in older] == [None, None]
    assert all(verify_checkpoint(c) is None for c in [newest, *older])
    # resuming from a model-only checkpoint is allowed but said to be inexact
    flip_byte(newest / "state.pt")
    with pytest.warns(UserWarning, match="NOT exact"):
        assert resumed_version(cfg, run_dir) == 2


def test_save_optimizer_none_writes_no_optimizer(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 1, "run.save_optimizer": "none"})
    assert load_state(latest_checkpoint(train(cfg, **DATA)))["optimizer"] is None
