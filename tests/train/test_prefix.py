"""The shared-prompt forward (bapo.train.prefix, Prefix Grouper) and the length buckets give the
log-probs and gradients of today's one padded forward (`padded_log_probs`), within float32 rounding.

The bound, for float32 weights: log-probs within 1e-5 (absolute; they are O(1-10) here) and the
gradient of a loss within 1e-5 relative (L2 over every parameter). Why that is rounding and not a
bug: both paths add the same terms in other orders and blockings (a prompt's keys computed once
instead of once per row, matmuls of other shapes, attention over P' + R instead of P + R keys with
the extra ones masked to exact zeros, a gradient summed over G rows into one prompt instead of over
G copies). float32 rounds each operation by at most u = 2^-24 = 6e-8 relative; a reordered n-term sum
moves by ~sqrt(n) u in practice (n u at worst): n = 128-384 on these 2-layer models gives ~1e-6 per
layer, a few layers and the vocabulary's log-sum-exp add a few of those, so ~2-5e-6 is the noise
level; measured 6e-7 (log-prob) and 4e-7 (gradient). A wrong position, mask or cache row moves log-
probs by O(0.1-1). The same check on SmolLM2-135M (30 layers) is in tests/real/test_smollm2.py.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bapo.train.logprobs as logprobs_module
import bapo.train.prefix as prefix
from bapo.train import Trainer
from bapo.train.logprobs import padded_log_probs, token_log_probs
from bapo.train.prefix import length_buckets, prompt_groups
from bapo.train.rollout import pad
from bapo.train.tiny import ModelConfig, build_model, build_tokenizer
from bapo.train.update import optimizer_update
from tests.helpers import arithmetic_examples, digit_share, make_config

LOG_PROB_ATOL = 1e-5  # float32 rounding (module docstring)
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def tiny_llama():
    """The demo's random-init Llama (bapo.train.tiny): 2 layers x 128, 4 heads."""
    return build_model(ModelConfig(), build_tokenizer())


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_model):
    """The trainer tests' tiny Qwen2 (tests/helpers.py): grouped-query attention, qkv biases."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def _rows(vocab: int, prompt_lengths, group: int, seed: int, interleave: bool = False):
    """Left-padded prompts of the given lengths, `group` right-padded responses each (lengths 1-11,
    every other one ending in EOS id 2), optionally with the groups' rows interleaved."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for length in prompt_lengths:
        prompt = [1] + torch.randint(4, vocab, (length - 1,), generator=gen).tolist()
        for index in range(group):
            response = torch.randint(4, vocab, (int(torch.randint(1, 12, (), generator=gen)),), generator=gen).tolist()
            if index % 2 == 0:
                response[-1] = 2  # EOS; the others are truncated replies
            prompts.append(prompt)
            responses.append(response)
    order = torch.randperm(len(prompts), generator=gen).tolist() if interleave else range(len(prompts))
    prompt_ids, prompt_mask = pad([prompts[i] for i in order], 0, left=True)
    response_ids, response_mask = pad([responses[i] for i in order], 0, left=False)
    return prompt_ids, prompt_mask, response_ids, response_mask


def _weights(mask: torch.Tensor) -> torch.Tensor:
    """Fixed per-token loss weights of both signs (a stand-in for advantages)."""
    return torch.linspace(-1.0, 1.5, mask.numel()).reshape(mask.shape) * mask


def _log_probs_and_grad(model, forward, rows, entropy_grad=False):
    response_mask = rows[3]
    model.zero_grad(set_to_none=True)
    args = (rows,) if forward is padded_log_probs else rows  # padded_log_probs takes the four as one tuple
    log_prob, entropy = forward(model, *args, 0.7, with_entropy=True, entropy_grad=entropy_grad)
    loss = (log_prob * _weights(response_mask)).sum()
    if entropy_grad:
        loss = loss + 0.1 * (entropy * response_mask).sum()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return log_prob.detach(), entropy.detach(), grad


@pytest.fixture
def shared_calls(monkeypatch):
    """Counts the shared-prompt forwards that ran (not fallbacks), so no test passes by falling back."""
    calls = []
    real = logprobs_module.shared_prompt_log_probs

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(logprobs_module, "shared_prompt_log_probs", spy)
    return calls


def _assert_equal_within_rounding(found, reference, mask):
    (log_prob, entropy, grad), (ref_log_prob, ref_entropy, ref_grad) = found, reference
    torch.testing.assert_close(log_prob[mask], ref_log_prob[mask], atol=LOG_PROB_ATOL, rtol=0)
    torch.testing.assert_close(entropy[mask], ref_entropy[mask], atol=LOG_PROB_ATOL, rtol=0)
    assert float((grad - ref_grad).norm() / ref_grad.norm()) <= GRAD_RTOL


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(
    "case",
    [
        dict(prompt_lengths=(5, 9, 3), group=4),  # left padding differs across groups
        dict(prompt_lengths=(7, 4, 7, 2), group=3, interleave=True),  # rows of a group not adjacent
        dict(prompt_lengths=(6, 6), group=8),  # one width, groups of 8
    ],
)
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("call_cost", [None, 0.0])
def test_shared_forward_equals_padded(request, model_name, case, entropy_grad, call_cost, shared_calls, monkeypatch):
    """call_cost 0: every distinct response length its own bucket (the tiny models' own call cost
    keeps one bucket), so the bucketed assembly is checked too."""
    if call_cost is not None:
        monkeypatch.setattr(prefix, "CALL_COST", call_cost)
    model = request.getfixturevalue(model_name)
    rows = _rows(model.config.vocab_size, seed=len(shared_calls), **case)
    found = _log_probs_and_grad(model, token_log_probs, rows, entropy_grad)
    reference = _log_probs_and_grad(model, padded_log_probs, rows, entropy_grad)
    assert shared_calls == [True]
    _assert_equal_within_rounding(found, reference, rows[3])


def test_a_wrong_position_is_caught(tiny_llama):
    """The bound separates rounding from a bug: shifting every response position by one (what a
    prompt-length mistake does) moves the log-probs far beyond it."""
    prompt_ids, prompt_mask, response_ids, response_mask = _rows(tiny_llama.config.vocab_size, (5, 9), 4, seed=3)
    with torch.no_grad():
        right, _ = padded_log_probs(tiny_llama, (prompt_ids, prompt_mask, response_ids, response_mask), 0.7)
        shifted_mask = torch.cat([torch.ones_like(prompt_mask[:, :1]), prompt_mask], dim=1)
        shifted_ids = torch.cat([prompt_ids[:, :1], prompt_ids], dim=1)  # one more prompt token
        wrong, _ = padded_log_probs(tiny_llama, (shifted_ids, shifted_mask, response_ids, response_mask), 0.7)
    assert (right - wrong)[response_mask].abs().max() > 100 * LOG_PROB_ATOL


def test_partial_rollout_batches_and_their_behaviour_log_probs(tiny_model, tmp_path, shared_calls):
    """Partial rollout (segments of 3 tokens, sampler hf so the behaviour log-probs are the trainer's
    recompute, each segment's context = prompt + earlier segments): the stored behaviour log-prob of
    every token equals one padded forward over the finished batch, and the batch's update forward
    (prompt = the original prompt, response = all segments) equals the padded one."""
    cfg = make_config(
        tiny_model,
        tmp_path / "run",
        **{
            "rollout.segment_tokens": 3,
            "rollout.max_new_tokens": 10,
            "rollout.prompts_per_batch": 2,
            "rollout.sampler": "hf",
        },
    )
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    batches = [trainer.rollout_step()[0] for _ in range(4)]  # no update: one policy sampled every token
    trainer.close()
    batch = next(b for b in batches if len(b) and (b.response_mask.sum(1) > 3).any())
    rows = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    with torch.no_grad():
        padded, _ = padded_log_probs(trainer.model, rows, cfg.rollout.temperature)
    torch.testing.assert_close(
        batch.old_log_prob[batch.response_mask], padded[batch.response_mask], atol=LOG_PROB_ATOL, rtol=0
    )
    assert len(shared_calls) > 0 and all(shared_calls)  # the recompute of later segments shared the prompt too
    shared_calls.clear()
    model = trainer.model
    _assert_equal_within_rounding(
        _log_probs_and_grad(model, token_log_probs, rows), _log_probs_and_grad(model, padded_log_probs, rows), rows[3]
    )
    assert shared_calls == [True]


def test_update_is_the_same_with_the_switch_off(tiny_model, tmp_path):
    """A whole optimizer update (micro-batches of 5 rows: groups of 4 split across them) moves the
    weights the same with model.shared_prompt_forward on and off."""
    cfg = make_config(tiny_model, tmp_path / "run", **{"optim.micro_batch_size": 5, "loss.method": "grpo"})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    batch, _ = trainer.rollout_step()
    trainer.close()
    deltas = []
    for shared in (True, False):
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.model.shared_prompt_forward = shared
        model = copy.deepcopy(trainer.model)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        metrics = optimizer_update(model, optimizer, scheduler, batch, run_cfg)
        deltas.append((metrics, torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])))
    (on, d_on), (off, d_off) = deltas
    assert float(d_off.norm()) > 0
    assert float((d_on - d_off).norm() / d_off.norm()) <= GRAD_RTOL
    assert on["loss"] == pytest.approx(off["loss"], abs=LOG_PROB_ATOL)


def test_falls_back_with_one_reason(tiny_llama, caplog, monkeypatch):
    """Gradient checkpointing in train mode (no KV cache) and a sliding-window cache run the padded
    forward, each reason logged once; the result is the padded forward's."""
    from transformers import MistralConfig, MistralForCausalLM

    monkeypatch.setattr(prefix, "_logged", set())  # once per process: earlier tests may have logged these

    rows = _rows(tiny_llama.config.vocab_size, (5, 8), 3, seed=1)
    torch.manual_seed(0)
    sliding = MistralForCausalLM(
        MistralConfig(
            vocab_size=tiny_llama.config.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            sliding_window=4,
        )
    )
    checkpointed = copy.deepcopy(tiny_llama)
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    with caplog.at_level(logging.WARNING, logger="bapo.train.prefix"):
        for model in (sliding, sliding, checkpointed, checkpointed):
            with torch.no_grad():
                found, _ = token_log_probs(model, *rows, 0.7)
                reference, _ = padded_log_probs(model, rows, 0.7)
            torch.testing.assert_close(found[rows[3]], reference[rows[3]], atol=LOG_PROB_ATOL, rtol=0)
    messages = [record.getMessage() for record in caplog.records]
    assert sum("sliding window" in m for m in messages) == 1
    assert sum("gradient checkpointing" in m for m in messages) == 1


def test_prompt_groups_number_prompts_by_first_row():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [5, 5, 6], [7, 8, 9]])
    mask = ids != 0
    first, group = prompt_groups(ids, mask)
    assert first.tolist() == [0, 1, 3] and group.tolist() == [0, 1, 0, 2, 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 64), min_size=1, max_size=40), st.floats(0, 500))
def test_length_buckets_partition_rows_and_never_cost_more(lengths, cost):
    """Buckets cover every row once, hold ascending lengths, and cost (rows x longest + call cost)
    no more than one bucket of all rows."""
    lengths_t = torch.tensor(lengths)
    buckets = length_buckets(lengths_t, cost)
    assert sorted(torch.cat(buckets).tolist()) == list(range(len(lengths)))
    flat = torch.cat([lengths_t[rows] for rows in buckets]).tolist()
    assert flat == sorted(flat)
    total = sum(len(rows) * int(lengths_t[rows].max()) + cost for rows in buckets)
    assert total <= len(lengths) * max(lengths) + cost
    if cost == 0:  # free calls: one bucket per distinct length
        assert len(buckets) == len(set(lengths))


def test_shared_forward_under_bf16_autocast(tiny_llama, shared_calls):
    """model.autocast=bfloat16: the shared forward's gradient is within test_autocast's bf16 bound
    (0.025 relative, cosine >= 0.999) of the fp32 padded forward's, as the padded bf16 one must be:
    the prompt's cached keys / values are bf16 like the padded forward's."""
    from functools import partial

    from tests.train.test_autocast import GRAD_COSINE_MIN, GRAD_REL_TOL

    rows = _rows(tiny_llama.config.vocab_size, (5, 9, 3), 4, seed=2)
    _, _, fp32 = _log_probs_and_grad(tiny_llama, padded_log_probs, rows)
    _, _, bf16 = _log_probs_and_grad(tiny_llama, partial(token_log_probs, autocast="bfloat16"), rows)
    assert shared_calls == [True]
    assert float((bf16 - fp32).norm() / fp32.norm()) <= GRAD_REL_TOL
    assert float(torch.nn.functional.cosine_similarity(bf16, fp32, dim=0)) >= GRAD_COSINE_MIN
