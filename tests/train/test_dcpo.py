"""`bapo train` with loss.method=dcpo runs DCPO: the paper's aggregation (loss.agg_mode null) and
its smooth advantage standardisation over each prompt's reward history (loss.advantages)."""

from types import SimpleNamespace

import pytest
import torch

from bapo.core import PromptRewardHistory
from bapo.train import train
from bapo.train.data import PromptSampler
from bapo.train.rollout import Rollout
from bapo.train.update import _normalizer
from tests.helpers import arithmetic_examples, digit_share, make_config


@pytest.mark.parametrize(
    ("method", "agg_mode", "expected"),
    [
        ("grpo", None, "token-mean"),
        ("clip-higher", None, "token-mean"),
        ("bapo", None, "token-mean"),
        ("dcpo", None, "seq-mean-token-sum"),
        ("dcpo", "token-mean", "token-mean"),  # an explicit setting is kept
        ("grpo", "seq-mean-token-sum", "seq-mean-token-sum"),
    ],
)
def test_agg_mode_null_resolves_to_the_methods_paper(tmp_path, method, agg_mode, expected):
    overrides = {"loss.method": method} | ({} if agg_mode is None else {"loss.agg_mode": agg_mode})
    cfg = make_config("unused", tmp_path, **overrides)
    assert cfg.loss.agg_mode == agg_mode
    assert cfg.loss.resolved_agg_mode == expected
    # the update's normalizer follows the resolved mode: tokens for token-mean, responses otherwise
    batch = type("FakeBatch", (), {"tokens": 37, "__len__": lambda self: 8})()
    assert _normalizer(cfg, batch) == (37.0 if expected == "token-mean" else 8.0)


@pytest.mark.parametrize(
    ("method", "advantages", "expected"),
    [
        ("dcpo", "auto", "dcpo_smooth"),
        ("grpo", "auto", "group"),
        ("dcpo", "group", "group"),
        ("bapo", "dcpo_smooth", "dcpo_smooth"),
    ],
)
def test_advantages_auto_is_smooth_for_dcpo_only(tmp_path, method, advantages, expected):
    cfg = make_config("unused", tmp_path, **{"loss.method": method, "loss.advantages": advantages})
    assert cfg.loss.resolved_advantages == expected


def test_bad_advantages_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="loss.advantages"):
        make_config("unused", tmp_path, **{"loss.advantages": "smooth"})


def bare_rollout(cfg) -> Rollout:
    """A Rollout that can only turn finished groups into a Batch (no model, no verifier)."""
    tokenizer = SimpleNamespace(pad_token_id=0)
    return Rollout(cfg, tokenizer, [[5, 6]] * 3, [{}] * 3, None, PromptSampler(3, 0), eos_ids=[1])


def groups(examples: list[int], rewards: list[list[float]]) -> list[dict]:
    seqs = [{"response": [7], "logp": [0.0], "version": [0], "truncated": False}] * 4
    return [{"example": e, "seqs": seqs, "rewards": r} for e, r in zip(examples, rewards)]


def test_dcpo_advantages_are_smooth_over_each_prompts_history(tmp_path):
    cfg = make_config("unused", tmp_path, **{"loss.method": "dcpo"})
    rollout = bare_rollout(cfg)
    first, _, _ = rollout._to_batch(groups([0, 1], [[1, 0, 0, 0], [0, 1, 1, 0]]))
    # no history yet: GRPO's standardisation, (R - mean) / std (unbiased std)
    torch.testing.assert_close(first.advantages[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]))
    second, _, zero_var = rollout._to_batch(groups([0, 2], [[1, 1, 1, 1], [1, 0, 0, 0]]))
    # prompt 0's second step has zero variance: mean_2 = (0.25 + 1) / 2, var_2 = (0.25 + 0 + 1/2 * 0.75^2) / 2,
    # A_new = 0, A_total = (1 - mean_2) / std_2, advantage = A_total / 2 (both mixtures agree)
    expected = (1 - 0.625) / (0.265625**0.5) / 2
    torch.testing.assert_close(second.advantages[:4], torch.full((4,), expected))
    assert zero_var == 1  # still counted as a zero-variance group
    torch.testing.assert_close(second.advantages[4:], first.advantages[:4])  # prompt 2 is new
    # the same as PromptRewardHistory on the same rewards
    history = PromptRewardHistory()
    history.advantages([0, 1], first.rewards, 4)
    torch.testing.assert_close(second.advantages, history.advantages([0, 2], second.rewards, 4).float())


def test_a_prompt_twice_in_one_batch_is_two_successive_steps(tmp_path):
    cfg = make_config("unused", tmp_path, **{"loss.method": "dcpo"})
    rewards = [[1, 0, 0, 0], [0, 1, 1, 0], [1, 1, 0, 1]]
    batch, _, _ = bare_rollout(cfg)._to_batch(groups([0, 1, 0], rewards))
    history = PromptRewardHistory()
    first = history.advantages([0, 1], torch.tensor(rewards[0] + rewards[1], dtype=torch.float32), 4)
    again = history.advantages([0], torch.tensor(rewards[2], dtype=torch.float32), 4)
    torch.testing.assert_close(batch.advantages, torch.cat([first, again]).float())


def test_group_advantages_keep_no_history(tmp_path):
    cfg = make_config("unused", tmp_path, **{"loss.method": "dcpo", "loss.advantages": "group"})
    rollout = bare_rollout(cfg)
    rollout._to_batch(groups([0], [[1, 0, 0, 0]]))
    batch, _, _ = rollout._to_batch(groups([0], [[1, 1, 1, 1]]))
    assert rollout.history.stats == {}
    assert torch.equal(batch.advantages, torch.zeros(4))


def test_a_dcpo_run_trains_on_prompt_reward_history_advantages(tiny_model, tmp_path, monkeypatch):
    seen = []
    to_batch = Rollout._to_batch

    def recording(self, groups):
        out = to_batch(self, groups)
        seen.append(out[0])
        return out

    monkeypatch.setattr(Rollout, "_to_batch", recording)
    # 5 prompts, 4 per step: prompts repeat across steps (and within one), so history matters
    cfg = make_config(tiny_model, tmp_path, **{"loss.method": "dcpo", "run.rollout_steps": 3})
    train(cfg, examples=arithmetic_examples(5), verifier=digit_share)
    assert len(seen) == 3
    history, group = PromptRewardHistory(), cfg.rollout.group_size
    for batch in seen:
        keys = batch.example_idx[::group].tolist()
        expected = torch.cat(
            [history.advantages([key], batch.rewards[i * group : (i + 1) * group], group) for i, key in enumerate(keys)]
        )
        torch.testing.assert_close(batch.advantages, expected.float())
    assert max(steps for _, _, steps in history.stats.values()) > 1  # some prompt was seen again
