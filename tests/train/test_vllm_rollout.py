"""rollout.backend=vllm's bookkeeping without vLLM: a fake engine (bapo's lean sampler on the
trainer's model, its log-probs shifted by a known offset) in place of bapo.train.vllm_engine.
One push per policy version, the trainer's recompute as the ratio's denominator, the engine's
log-probs kept next to it, the gap logged every update."""

import json

import pytest
import torch

from bapo.train import Trainer
from bapo.train.rollout import Rollout, pad
from bapo.train.sampling import lean_sample
from tests.helpers import arithmetic_examples, batch_log_probs, digit_share, make_config

OFFSET = 0.03


class FakeEngine:
    def __init__(self):
        self.synced: list[int] = []
        self.version = None
        self.pushes, self.push_seconds, self.sample_seconds = 0, 0.0, 0.0
        self.model = None
        self.closed = False

    def close(self):
        self.closed = True

    def sync(self, model, version):
        self.model = model
        if self.version == version:
            return False
        self.version = version
        self.synced.append(version)
        self.pushes += 1
        return True

    def sample(self, contexts, budgets, params, eos_ids, pad_id):
        ids, mask = pad(contexts, pad_id, left=True)
        sampled = lean_sample(
            self.model, ids, mask, max(budgets), params, eos_ids, pad_id, row_budget=torch.tensor(budgets)
        )
        sampled.log_prob = sampled.log_prob + OFFSET
        return sampled


@pytest.mark.parametrize("extra", [{"offpolicy.async_delay": 1}, {"rollout.segment_tokens": 3}])
def test_one_push_per_version_and_the_gap_is_logged(tiny_model, tmp_path, monkeypatch, extra):
    engine = FakeEngine()
    monkeypatch.setattr(Rollout, "_vllm_engine", lambda self, model: setattr(self, "engine", engine) or engine)
    cfg = make_config(
        tiny_model,
        tmp_path / "run",
        **{"rollout.backend": "vllm", "rollout.correction": "tis", "offpolicy.mini_batches": 2, **extra},
    )
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    trainer.fit()
    trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "update" in row]
    # versions 0, 2, 4 (two updates per rollout step); warm-up and partial passes push nothing new
    assert engine.synced == [0, 2, 4]
    for row in rows:
        # old_log_prob is the trainer's recompute: the engine's shifted log-probs differ by OFFSET
        assert row["rollout/logp_diff/mean"] == pytest.approx(OFFSET, abs=2e-5)
        assert row["rollout/logp_diff/max"] == pytest.approx(OFFSET, abs=2e-5)
        assert row["rollout/is_ratio/mean"] == pytest.approx(torch.exp(torch.tensor(-OFFSET)).item(), rel=1e-4)
        assert row["rollout/is_weight/mean"] == pytest.approx(row["rollout/is_ratio/mean"], rel=1e-6)
    assert rows[-1]["rollout/vllm_pushes"] == 1  # the last rollout step pushed version 4
    assert engine.closed and trainer.rollout.engine is None  # the run's end shut the engine down


def test_sample_texts_draws_from_the_engine_at_the_current_version_and_leaves_rng_alone(
    tiny_model, tmp_path, monkeypatch
):
    """Held-out scoring (bapo study) samples with the run's engine: the current weights pushed
    once, one decoded string per (prompt, sample), the same texts for the same seed, and no RNG
    of the run moved (evaluating must not change training)."""
    engine = FakeEngine()
    monkeypatch.setattr(Rollout, "_vllm_engine", lambda self, model: setattr(self, "engine", engine) or engine)
    cfg = make_config(tiny_model, tmp_path / "run", **{"rollout.backend": "vllm"})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    before = torch.get_rng_state()
    texts = trainer.sample_texts(["1+2=", "3+4=", "5+6="], 4, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert [len(group) for group in texts] == [4, 4, 4] and all(isinstance(t, str) for g in texts for t in g)
    assert engine.synced == [0]
    assert trainer.sample_texts(["1+2=", "3+4=", "5+6="], 4, seed=7) == texts
    assert engine.synced == [0]  # same version: nothing pushed again
    trainer.close()


@pytest.mark.parametrize("extra", [{}, {"rollout.segment_tokens": 3}])
def test_engine_log_probs_as_the_behaviour_ones_recompute_one_group_and_log_the_gap(
    tiny_model, tmp_path, monkeypatch, extra
):
    """rollout.behaviour_log_prob=engine (verl's bypass mode): the batch's behaviour log-probs are the
    engine's own, the correction has nothing to weigh, and only G rows (a group's worth) per generation pass
    are recomputed by the trainer: enough to log the gap every rollout step (here OFFSET, above the
    warning limit, so the run warns)."""
    from bapo.train import rollout as rollout_module

    engine = FakeEngine()
    monkeypatch.setattr(Rollout, "_vllm_engine", lambda self, model: setattr(self, "engine", engine) or engine)
    recomputed_rows: list[int] = []
    recompute = Rollout._recompute

    def counting(self, model, owners, live, *tensors):
        recomputed_rows.append(len(live))
        return recompute(self, model, owners, live, *tensors)

    monkeypatch.setattr(Rollout, "_recompute", counting)
    monkeypatch.setattr(rollout_module, "ENGINE_GAP_LIMIT", 0.01)  # OFFSET is above it
    overrides = {"rollout.backend": "vllm", "rollout.behaviour_log_prob": "engine", "rollout.group_size": 4, **extra}
    cfg = make_config(tiny_model, tmp_path / "run", **overrides)
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    with pytest.warns(UserWarning, match="behaviour_log_prob=recompute"):
        batch, metrics = trainer.rollout_step()
    assert batch.engine_log_prob is None  # nothing to correct: the denominator is the engine's
    assert recomputed_rows and set(recomputed_rows) == {4}  # G rows per pass, not the batch
    assert metrics["rollout/logp_diff/mean"] == pytest.approx(OFFSET, abs=2e-5)
    assert metrics["rollout/logp_diff/max"] == pytest.approx(OFFSET, abs=2e-5)
    # the stored behaviour log-probs are the engine's: the trainer's recompute plus OFFSET
    trainer_lp = batch_log_probs(trainer, batch)
    mask = batch.response_mask
    torch.testing.assert_close(batch.old_log_prob[mask], trainer_lp[mask] + OFFSET, atol=2e-5, rtol=0)
    rows = trainer.update_step(batch)
    assert all(row["skipped"] == 0 for row in rows)
    trainer.close()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"rollout.backend": "hf"}, "needs rollout.backend=vllm"),
        ({"rollout.backend": "vllm", "rollout.vllm_dtype": "bfloat16"}, "needs a float32 engine and trainer"),
        ({"rollout.backend": "vllm", "model.dtype": "bfloat16"}, "needs a float32 engine and trainer"),
        ({"rollout.backend": "vllm", "model.autocast": "bfloat16"}, "needs a float32 engine and trainer"),
        ({"rollout.backend": "vllm", "rollout.correction": "tis"}, "with rollout.correction=tis"),
    ],
)
def test_engine_behaviour_log_probs_are_refused_where_they_are_not_the_trainers_policy(overrides, expected):
    from bapo.train import ConfigError, load_config

    base = {"model.dtype": "float32", "rollout.behaviour_log_prob": "engine"}  # the example config is bf16
    args = [f"{key}={value}" for key, value in {**base, **overrides}.items()]
    with pytest.raises(ConfigError, match=f"rollout.behaviour_log_prob=engine {expected}"):
        load_config("examples/configs/bapo_math.yaml", args)
    accepted = [f"{key}={value}" for key, value in {**base, "rollout.backend": "vllm"}.items()]
    assert load_config("examples/configs/bapo_math.yaml", accepted).rollout.behaviour_log_prob == "engine"
