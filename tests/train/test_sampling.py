"""The lean sampling loop draws what HF `generate` draws (same seed -> same tokens), its log-probs
are the recompute's, and the rollout picks it (or the fallback) by `rollout.sampler`."""

from __future__ import annotations

import pytest
import torch

from bapo.train.logprobs import batched_log_probs
from bapo.train.rollout import pad
from bapo.train.sampling import (
    SamplingParams,
    hf_sample,
    lean_sample,
    lean_supported,
    resolve_sampler,
)
from tests.helpers import arithmetic_examples, make_config

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=3),
]


@pytest.fixture(scope="module")
def loaded(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    # prompts of several lengths (left padding), 4 copies each as in a GRPO group
    prompts = [tokenizer.encode(row["prompt"]) for row in arithmetic_examples(6, seed=3) for _ in range(4)]
    prompts[0] = prompts[0] + tokenizer.encode("12")  # a longer context, as in partial rollout
    ids, mask = pad(prompts, tokenizer.pad_token_id, left=True)
    return model, tokenizer, ids, mask


def _until_eos(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """[n, m] bool: the tokens up to and including each row's first EOS."""
    hit = (tokens == eos).long()
    return (hit.cumsum(1) - hit) == 0


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("seed", [0, 1])
def test_lean_draws_the_same_tokens_as_generate(loaded, params, seed):
    model, tokenizer, ids, mask = loaded
    eos, pad_id = [tokenizer.eos_token_id], tokenizer.pad_token_id
    torch.manual_seed(seed)
    lean = lean_sample(model, ids, mask, 24, params, eos, pad_id)
    torch.manual_seed(seed)
    reference = hf_sample(model, ids, mask, 24, params, eos, pad_id)
    keep = _until_eos(reference.tokens, eos[0])
    assert lean.tokens.shape == reference.tokens.shape  # both stop when every row has ended
    assert torch.equal(lean.tokens[keep], reference.tokens[keep])
    assert (lean.tokens[~keep] == pad_id).all()
    assert 0 < keep.sum() < keep.numel()  # some rows ended early: the row-dropping path ran


@pytest.mark.parametrize("params", PARAMS[:3], ids=lambda p: f"T{p.temperature}")
def test_lean_log_probs_equal_the_recompute(loaded, params):
    model, tokenizer, ids, mask = loaded
    torch.manual_seed(0)
    lean = lean_sample(model, ids, mask, 24, params, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    keep = _until_eos(lean.tokens, tokenizer.eos_token_id)
    recomputed = batched_log_probs(model, ids, mask, lean.tokens, keep, params.temperature, chunk=7)
    assert torch.allclose(lean.log_prob[keep], recomputed[keep], atol=1e-5, rtol=0)
    # untruncated logits / T: top-k/top-p do not renormalise the behaviour log-prob
    assert (lean.log_prob[keep] < 0).all()


def test_row_budget_and_stop_end_rows(loaded):
    model, tokenizer, ids, mask = loaded
    budget = torch.arange(len(ids)) % 5 + 1
    calls = []

    def stop_after_three(sequences, _scores):  # a stop criterion in StopStringCriteria's signature
        calls.append(sequences.shape[1])
        return torch.full((sequences.shape[0],), sequences.shape[1] - ids.shape[1] >= 3)

    torch.manual_seed(0)
    out = lean_sample(
        model,
        ids,
        mask,
        10,
        SamplingParams(),
        [tokenizer.eos_token_id],
        tokenizer.pad_token_id,
        row_budget=budget,
        stop=stop_after_three,
    )
    assert out.tokens.shape[1] == 3 and len(calls) == 3
    sampled = out.tokens != tokenizer.pad_token_id
    assert (sampled.sum(1) <= budget).all()


def test_sampler_choice(loaded):
    model = loaded[0]
    assert lean_supported(model) and resolve_sampler("auto", model) == "lean"
    assert resolve_sampler("hf", model) == "hf"

    class NoCache(torch.nn.Module):  # a model the lean loop cannot drive
        config = model.config

        def forward(self, input_ids, attention_mask=None):
            raise AssertionError("not called")

    assert not lean_supported(NoCache()) and resolve_sampler("auto", NoCache()) == "hf"
    with pytest.raises(ValueError, match="rollout.sampler=lean"):
        resolve_sampler("lean", NoCache())


def test_rollout_batches_match_between_samplers(tiny_model, tmp_path):
    """Same seed, same config: the lean rollout and the generate rollout give the same batch
    (tokens exactly, behaviour log-probs to fp32 rounding)."""
    from bapo.train import Trainer
    from tests.helpers import digit_share

    batches = {}
    for sampler in ("lean", "hf"):
        cfg = make_config(
            tiny_model,
            tmp_path / sampler,
            **{"rollout.sampler": sampler, "rollout.top_k": 6, "rollout.temperature": 0.9},
        )
        trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share, progress=False)
        batches[sampler], _ = trainer.rollout_step()
        trainer.close()
    lean, hf = batches["lean"], batches["hf"]
    assert torch.equal(lean.response_ids, hf.response_ids) and torch.equal(lean.response_mask, hf.response_mask)
    assert torch.allclose(lean.old_log_prob, hf.old_log_prob, atol=1e-5, rtol=0)
    assert torch.equal(lean.rewards, hf.rewards)
