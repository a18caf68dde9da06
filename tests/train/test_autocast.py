"""model.autocast=bfloat16 and the chunked chosen-token log-probs (bapo.train.logits).

The numerical check of bf16 autocast against fp32, on a fixed batch of the tiny Llama of
bapo.train.tiny (2 layers, random init): measured over seeds 0-3 and widths 128 / 256, the loss
moved by <= 6e-4 relative, the flattened gradient by <= 0.0081 relative (cosine >= 0.99997).
bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 0.002 per rounding), so errors of that size
are what a correct bf16 forward with float32 log-softmax and float32 accumulation of the loss
gives. The tolerances are ~3x the largest measured: LOSS_REL_TOL 2e-3, GRAD_REL_TOL 0.025,
cosine >= 0.999. A log-softmax taken in bf16 instead moves the loss by ~1e-2 and fails.
bench/real_model.py reports the same three numbers for SmolLM2-135M-Instruct (30 layers): loss
1.3e-2, gradient 6.7e-2 relative error, cosine 0.998 - more layers, more bf16 rounding; these
tolerances are for the tiny model only.
"""

import pytest
import torch

from bapo.train import ConfigError, config_from_dict
from bapo.train import logits as logits_module
from bapo.train.logits import chosen_log_probs, plain_log_probs
from bapo.train.logprobs import token_log_probs
from bapo.train.rollout import Batch
from bapo.train.tiny import ModelConfig, build_model, build_tokenizer
from bapo.train.update import optimizer_update
from bench.real_model import autocast_error

LOSS_REL_TOL = 2e-3
GRAD_REL_TOL = 0.025
GRAD_COSINE_MIN = 0.999


def fixed_batch(model, vocab: int, seed: int, rows: int = 8, prompt: int = 12, response: int = 16) -> Batch:
    """Random prompts/responses of unequal lengths, behaviour log-probs = the model's + N(0, 0.1)
    (ratios spread around 1, some clipped), advantages N(0.5, 1) (a loss well away from 0)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, vocab, (rows, prompt), generator=gen)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.bool)
    response_ids = torch.randint(4, vocab, (rows, response), generator=gen)
    lengths = torch.randint(response // 2, response + 1, (rows,), generator=gen)
    response_mask = torch.arange(response) < lengths[:, None]
    with torch.no_grad():
        log_prob, _ = token_log_probs(model, prompt_ids, prompt_mask, response_ids, response_mask, 1.0)
    old_log_prob = (log_prob + 0.1 * torch.randn(rows, response, generator=gen)) * response_mask
    advantages = torch.randn(rows, generator=gen) + 0.5
    return Batch(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        old_log_prob,
        torch.zeros(rows, response, dtype=torch.long),
        advantages,
        advantages,
        torch.zeros(rows, dtype=torch.bool),
        torch.arange(rows),
    )


@pytest.mark.parametrize("native", [True, False], ids=["torch-gemms", "fp32-emulated-gemms"])
@pytest.mark.parametrize("method", ["grpo", "bapo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_autocast_loss_and_gradient_agree_with_fp32(method, seed, native, monkeypatch):
    """Both bf16 paths (bapo.train.precision: torch.autocast's GEMMs, or fp32 GEMMs of rounded
    operands where the CPU lacks bf16 units) on whatever this CPU has."""
    import bapo.train.precision as precision

    monkeypatch.setattr(precision, "native_bf16", lambda device_type: native)
    tokenizer = build_tokenizer()
    model = build_model(ModelConfig(seed=seed), tokenizer)
    batch = fixed_batch(model, len(tokenizer), seed)
    cfg = config_from_dict({"model": {"path": "unused"}, "loss": {"method": method}})
    error = autocast_error(model, batch, cfg)
    assert abs(error["loss_fp32"]) > 0.05  # a relative error of a loss near 0 would say nothing
    assert error["loss_rel_err"] < LOSS_REL_TOL, error
    assert error["grad_rel_err"] < GRAD_REL_TOL, error
    assert error["grad_cosine"] > GRAD_COSINE_MIN, error
    assert error["loss_bf16"] != error["loss_fp32"]  # the bf16 forward did run
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "gradient-checkpointing"])
@pytest.mark.parametrize("native", [True, False], ids=["torch-gemms", "fp32-emulated-gemms"])
def test_autocast_update_runs_bf16_forwards_and_keeps_fp32_weights(
    tiny_model, tmp_path, monkeypatch, native, checkpointing
):
    """Both bf16 paths of bapo.train.precision, with and without gradient checkpointing (whose
    backward recompute must take the same path as the forward)."""
    import bapo.train.precision as precision
    from bapo.train import Trainer
    from tests.helpers import arithmetic_examples, digit_share, make_config
    from tests.train.test_precision import GemmDtypes

    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    overrides = {"model.autocast": "bfloat16", "loss.method": "bapo", "model.gradient_checkpointing": checkpointing}
    cfg = make_config(tiny_model, tmp_path / "run", **overrides)
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    linear_dtypes = set()
    hook = trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _module, _inputs, output: linear_dtypes.add(output.dtype)
    )
    batch, _ = trainer.rollout_step()
    # the lean sampler stays in fp32; the behaviour log-probs are recomputed in the update's precision
    assert linear_dtypes == {torch.float32, torch.bfloat16}
    linear_dtypes.clear()
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    with GemmDtypes() as kernels:
        metrics = optimizer_update(trainer.model, optimizer, scheduler, batch, cfg, version=trainer.version)
    hook.remove()
    trainer.close()
    assert linear_dtypes == {torch.bfloat16}  # every forward of the update ran under autocast
    # the GEMMs that ran, forward, recompute and backward: torch's bf16 ones, or fp32 ones only
    assert kernels.seen == ({torch.bfloat16, torch.float32} if native else {torch.float32})
    assert metrics["skipped"] == 0 and metrics["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(state["exp_avg"].dtype == torch.float32 for state in optimizer.state.values())
    # behaviour log-probs and update in the same precision: a fresh batch's ratios stay ~1
    assert metrics["ratio/max"] < 1.05


def test_autocast_needs_fp32_weights():
    with pytest.raises(ConfigError, match="model.autocast=bfloat16.*model.dtype=bfloat16"):
        config_from_dict({"model": {"path": "unused", "dtype": "bfloat16", "autocast": "bfloat16"}})


# logits [5, 3, 7]: 40 elements = one row a chunk; 10 = one token a chunk (a row of 3 x 7 is larger
# than a chunk: a long response goes a few positions at a time); 1 << 23: all rows in one chunk
@pytest.mark.parametrize("chunk_elements", [40, 10, 1 << 23])
def test_chunked_log_probs_equal_the_plain_ones_and_their_gradient(monkeypatch, chunk_elements):
    monkeypatch.setattr(logits_module, "CHUNK_ELEMENTS", chunk_elements)
    shape_chunks = logits_module._chunks(torch.empty(5, 3, 7))
    assert len(shape_chunks) == {40: 5, 10: 15, 1 << 23: 1}[chunk_elements]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    ids = torch.randint(0, 7, (5, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda z: chosen_log_probs(z, ids, 0.7)[0], (logits,))
    log_prob, entropy = chosen_log_probs(logits, ids, 0.7, with_entropy=True)
    want_log_prob, want_entropy = plain_log_probs(logits, ids, 0.7, with_entropy=True)
    torch.testing.assert_close(log_prob, want_log_prob)
    torch.testing.assert_close(entropy, want_entropy)
    assert not entropy.requires_grad  # a diagnostic: no graph through the vocabulary for it
    _, entropy_with_grad = chosen_log_probs(logits, ids, 0.7, with_entropy=True, entropy_grad=True)
    assert entropy_with_grad.requires_grad  # an entropy loss term takes the differentiable path
    half = logits.detach().to(torch.bfloat16).requires_grad_()
    log_prob, _ = chosen_log_probs(half, ids, 1.0)
    log_prob.sum().backward()
    assert log_prob.dtype == torch.float32 and half.grad.dtype == torch.bfloat16
