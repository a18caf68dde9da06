"""The loop on the tiny model: exact async delay, updates per batch, replay, partial rollout."""

import copy

import pytest
import torch

from bapo.train import Trainer, read_metrics, train
from bapo.train.logprobs import token_log_probs
from bapo.train.rollout import Batch
from tests.helpers import arithmetic_examples, digit_share, make_config


def run(tiny_model, tmp_path, **overrides):
    cfg = make_config(tiny_model, tmp_path / "run", **overrides)
    return read_metrics(train(cfg, examples=arithmetic_examples(), verifier=digit_share))


@pytest.mark.parametrize("k", [0, 2])
def test_async_delay_is_exact(tiny_model, tmp_path, k):
    rows = run(tiny_model, tmp_path, **{"offpolicy.async_delay": k, "run.rollout_steps": 5})
    assert [r["update"] for r in rows] == [1, 2, 3, 4, 5]
    for t, row in enumerate(rows):  # update t (0-based) trains on data of policy version t - k
        expected = max(t - k, 0)  # warm-up: the first k updates use version-0 batches
        assert row["batch/version_min"] == row["batch/version_max"] == expected
        assert row["policy_lag/mean"] == row["policy_lag/max"] == t - expected
        assert row["rollout/batch/version_min"] == t  # the fresh batch comes from the current policy
    if k == 0:  # on-policy: behaviour log-probs are the current ones, nothing is clipped
        assert all(abs(r["ratio/mean"] - 1) < 1e-5 and r["clip_frac"] == 0 for r in rows)
    else:
        assert max(abs(r["ratio/max"] - 1) for r in rows[2:]) > 1e-3
    # the trained batch at update t is exactly the fresh batch of rollout step t - k
    for t in range(k, len(rows)):
        assert rows[t]["reward/mean"] == rows[t - k]["rollout/reward/mean"]


def test_updates_per_batch_split_one_batch(tiny_model, tmp_path):
    overrides = {"offpolicy.mini_batches": 2, "offpolicy.epochs": 2, "run.rollout_steps": 2}
    rows = run(tiny_model, tmp_path, **overrides)
    assert [r["update"] for r in rows] == list(range(1, 9))
    assert make_config(tiny_model, tmp_path / "unused", **overrides).total_updates == len(rows)  # LR schedule length
    assert [r["rollout_step"] for r in rows] == [0] * 4 + [1] * 4
    assert [r["epoch"] for r in rows] == [0, 0, 1, 1] * 2
    # four updates on one batch of version 4s: policy lag 0, 1, 2, 3 within each batch
    assert [r["policy_lag/mean"] for r in rows] == [0, 1, 2, 3] * 2
    assert [r["batch/version_min"] for r in rows[4:]] == [4] * 4
    # the mini-batches of an epoch partition the batch: every generated token is trained once per epoch
    for first in range(0, len(rows), 2):
        pair = rows[first : first + 2]
        assert pair[0]["tokens/update"] + pair[1]["tokens/update"] == pair[0]["tokens/rollout"] > 0


def test_replay_mixes_several_ages(tiny_model, tmp_path):
    rows = run(
        tiny_model, tmp_path, **{"offpolicy.mode": "replay", "offpolicy.replay_batches": 3, "run.rollout_steps": 6}
    )
    assert rows[0]["batch/version_max"] == 0
    assert all(r["batch/version_max"] <= r["update"] - 1 for r in rows)
    assert all(r["update"] - 1 - r["batch/version_min"] <= 2 for r in rows)  # never older than the buffer
    assert any(r["batch/version_min"] < r["batch/version_max"] for r in rows[3:])  # ages mix


def test_partial_rollout_keeps_version_and_logprob_of_every_token(tiny_model, tmp_path):
    L, max_new = 3, 8
    cfg = make_config(
        tiny_model,
        tmp_path / "run",
        **{"rollout.segment_tokens": L, "rollout.max_new_tokens": max_new, "rollout.prompts_per_batch": 2},
    )
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    snapshots = {0: copy.deepcopy(trainer.model.state_dict())}
    batches, passes = [], {}
    for _ in range(5):
        batch, metrics = trainer.rollout_step()
        batches.append(batch)
        passes[trainer.version] = metrics["rollout/passes"]
        assert len(batch) == 2 * 4 and metrics["tokens/rollout"] > 0
        trainer.update_step(batch)
        snapshots[trainer.version] = copy.deepcopy(trainer.model.state_dict())
    trainer.close()
    # a response spans several policy versions, in order, at most L tokens per generation pass
    mixed = 0
    for batch in batches:
        for versions, mask in zip(batch.versions, batch.response_mask):
            v = versions[mask].tolist()
            assert v == sorted(v) and len(v) <= max_new
            assert all(v.count(x) <= L * passes[x] for x in set(v))
            mixed += len(set(v)) > 1
    assert mixed > 0
    assert max(passes.values()) > 1 and passes[4] == 1  # the pipeline fills at first, then one pass a step
    # every stored behaviour log-prob is the log-prob under the version that sampled the token
    probe = copy.deepcopy(trainer.model)
    for batch in batches[2:]:
        for version in batch.versions[batch.response_mask].unique().tolist():
            probe.load_state_dict(snapshots[version])
            with torch.no_grad():
                lp, _ = token_log_probs(
                    probe,
                    batch.prompt_ids,
                    batch.prompt_mask,
                    batch.response_ids,
                    batch.response_mask,
                    cfg.rollout.temperature,
                )
            at = batch.response_mask & (batch.versions == version)
            torch.testing.assert_close(lp[at], batch.old_log_prob[at], atol=1e-4, rtol=0)


def test_stop_strings_end_responses(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"rollout.stop": "['1', 'a']", "rollout.max_new_tokens": 12})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    batch, _ = trainer.rollout_step()
    trainer.close()
    texts = trainer.tokenizer.batch_decode(
        [ids[m].tolist() for ids, m in zip(batch.response_ids, batch.response_mask)], skip_special_tokens=True
    )
    ended = [t for t, cut in zip(texts, batch.truncated.tolist()) if not cut]
    assert ended, "some response should hit a stop string or EOS"
    for text in texts:
        body = text[:-1] if text.endswith(("1", "a")) else text
        assert "1" not in body and "a" not in body, text  # nothing generated past a stop string


def test_zero_variance_groups_dropped_or_kept(tiny_model, tmp_path):
    def constant(response, example):
        return 1.0

    cfg = make_config(tiny_model, tmp_path / "a", **{"loss.zero_variance": "drop", "run.rollout_steps": 2})
    rows = read_metrics(train(cfg, examples=arithmetic_examples(), verifier=constant))
    assert all(r["groups/dropped"] == 4 and r.get("empty_batch") == 1 and r["skipped"] == 1 for r in rows)
    cfg = make_config(tiny_model, tmp_path / "b", **{"run.rollout_steps": 2})
    rows = read_metrics(train(cfg, examples=arithmetic_examples(), verifier=constant))
    assert all(r["groups/zero_variance"] == 4 and r["groups/dropped"] == 0 for r in rows)
    assert all(r["grad_norm"] == 0.0 for r in rows)  # zero advantages: no gradient


def test_kl_entropy_and_callback(tiny_model, tmp_path):
    seen = []

    def on_update(update, model, tokenizer):
        seen.append(update)
        torch.rand(100)  # consumes RNG: must not change the run
        return {"eval/accuracy": 0.5}

    cfg = make_config(
        tiny_model,
        tmp_path / "run",
        **{"loss.kl_coef": 0.1, "loss.entropy_coef": 0.01, "loss.method": "clip-higher", "run.rollout_steps": 2},
    )
    rows = read_metrics(train(cfg, on_update, examples=arithmetic_examples(), verifier=digit_share))
    assert seen == [1, 2] and all(r["eval/accuracy"] == 0.5 for r in rows)
    assert rows[0]["kl_loss"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl_loss"] > 0
    assert all(r["entropy_loss"] > 0 and r["upper"] == 1.28 for r in rows)


def test_gradient_checkpointing_keeps_train_mode_for_updates(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"model.gradient_checkpointing": True})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    batch, _ = trainer.rollout_step()
    assert trainer.model.training  # generate() ran in eval mode (KV cache), then train mode came back
    rows = trainer.update_step(batch)
    trainer.close()
    assert rows[0]["grad_norm"] > 0 and rows[0]["skipped"] == 0


def test_rollout_step_rows_join_rollout_metrics_to_every_update_and_the_hook_to_the_last():
    from bapo.train.trainer import _rollout_step_rows

    mask = torch.tensor([[True, True, False], [True, False, False]])
    fresh = Batch(
        torch.ones(2, 1, dtype=torch.long),
        torch.ones(2, 1, dtype=torch.bool),
        torch.ones(2, 3, dtype=torch.long),
        mask,
        torch.zeros(2, 3),
        torch.where(mask, 4, -1),
        torch.tensor([1.0, 0.0]),
        torch.tensor([1.0, -1.0]),
        torch.tensor([False, True]),
        torch.tensor([0, 0]),
    )
    updates = [{"update": 5, "tokens/update": 30}, {"update": 6, "tokens/update": 10}]
    rows = _rollout_step_rows(
        updates,
        {"tokens/rollout": 50, "groups/dropped": 0},
        fresh,
        correct_threshold=1.0,
        rollout_step_seconds=2.0,
        hook_metrics={"eval/accuracy": 0.25},
    )
    assert [row["tokens_per_s"] for row in rows] == [40.0, 30.0]  # (rollout + this update's tokens) / step time
    assert all(row["time/rollout_step_s"] == 2.0 and row["groups/dropped"] == 0 for row in rows)
    assert rows[0]["rollout/accuracy"] == 0.5 and rows[0]["rollout/response_length/max"] == 2.0
    assert rows[0]["rollout/batch/version_min"] == 4 and rows[1]["rollout/response_length/truncated_frac"] == 0.5
    assert "eval/accuracy" not in rows[0] and rows[1]["eval/accuracy"] == 0.25  # the hook runs once per rollout step
