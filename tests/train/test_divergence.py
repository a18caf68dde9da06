"""The divergence guard (run.divergence) and update bookkeeping when zero-variance groups are dropped."""

import math

import pytest

from bapo.train import Trainer, TrainingStopped, read_metrics, train
from bapo.train.checkpoint import latest_checkpoint
from tests.helpers import arithmetic_examples, digit_share, make_config

DATA = {"examples": arithmetic_examples(), "verifier": digit_share}


def test_exploding_weights_stop_with_a_checkpoint(tiny_model, tmp_path):
    cfg = make_config(
        tiny_model, tmp_path / "run", **{"optim.lr": 1e30, "optim.max_grad_norm": "null", "run.rollout_steps": 5}
    )
    with pytest.raises(TrainingStopped, match="a weight reached .* run.divergence.max_abs_weight=10000"):
        train(cfg, **DATA)
    assert latest_checkpoint(tmp_path / "run").name == "update_000001"
    assert len(read_metrics(tmp_path / "run")) == 1


def test_all_zero_variance_for_n_steps_stops(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 6, "run.divergence.zero_variance_steps": 2})
    with pytest.raises(TrainingStopped, match="zero reward variance .* for 2 rollout steps in a row"):
        train(cfg, examples=arithmetic_examples(), verifier=lambda response, example: 0.0)
    assert latest_checkpoint(tmp_path / "run").name == "update_000002"
    cfg = make_config(tiny_model, tmp_path / "off", **{"run.rollout_steps": 3, "run.divergence.zero_variance_steps": 0})
    train(cfg, examples=arithmetic_examples(), verifier=lambda response, example: 0.0)  # 0 = off: runs to the end


def test_entropy_rising_to_log_vocab_stops_but_starting_there_does_not(tiny_model, tmp_path):
    trainer = Trainer(make_config(tiny_model, tmp_path / "run"), **DATA)
    trainer.close()
    log_vocab = math.log(trainer.model.get_output_embeddings().weight.shape[0])
    assert trainer._divergence([{"entropy": 0.99 * log_vocab}]) is None  # a random init starts near uniform
    assert trainer._divergence([{"entropy": 0.5 * log_vocab}]) is None
    what, hint = trainer._divergence([{"entropy": 0.96 * log_vocab}])
    assert "close to uniform" in what and "optim.lr" in hint


@pytest.mark.parametrize("split, mini_batches", [("rows", 8), ("groups", 2)])
def test_dropped_groups_never_lose_update_slots(tiny_model, tmp_path, split, mini_batches):
    """Fewer rows (groups) than mini-batches after dropping zero-variance groups: every rollout step
    still counts exactly mini_batches x epochs updates (empty ones skipped) and the version is derived."""
    examples = arithmetic_examples(2)

    def flat_but_one(response, example):
        return float(len(response) % 2) if example is examples[0] else 0.0

    cfg = make_config(
        tiny_model,
        tmp_path / "run",
        **{
            "rollout.prompts_per_batch": 2,
            "rollout.group_size": 4,
            "loss.zero_variance": "drop",
            "offpolicy.mini_batches": mini_batches,
            "offpolicy.minibatch_split": split,
            "offpolicy.epochs": 2,
            "offpolicy.async_delay": 1,
            "run.rollout_steps": 3,
        },
    )
    seen = []
    rows = read_metrics(
        train(cfg, lambda version, model, tok: seen.append(version), examples=examples, verifier=flat_but_one)
    )
    per_batch = 2 * mini_batches
    assert seen == [per_batch, 2 * per_batch, 3 * per_batch]
    assert [r["update"] for r in rows] == list(range(1, 3 * per_batch + 1))
    assert any(r.get("empty_batch") for r in rows) and any(not r["skipped"] for r in rows)
    for r in rows:
        if not r.get("empty_batch"):  # policy lag counted in updates from the derived version
            assert r["policy_lag/max"] <= 2 * per_batch - 1
