"""model.lora: LoRA adapters (peft) trained instead of every weight.

Float tolerance: the merged weight W + s * B @ A is rounded once per element (float32, 2^-24
relative) and then multiplies the activations, where the adapted model computes x @ W + s * (x @ A) @ B
in another order; through the tiny model's 2 layers that moves a log-prob by ~1e-7. TOL = 1e-5 is
the bound the sampler tests use for two fp32 paths over the same weights (tests/train/test_sampling.py),
while the adapter moves every log-prob by > 1e-2 here (checked, so the comparisons can fail).
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("peft")

from bapo.train import ConfigError, Trainer, read_metrics, train  # noqa: E402
from bapo.train.config_io import load_config  # noqa: E402
from bapo.train.logprobs import batched_log_probs  # noqa: E402
from bapo.train.lora import adapter_dropout, add_lora, merged_weights  # noqa: E402
from bapo.train.rollout import pad  # noqa: E402
from bapo.train.sampling import SamplingParams, hf_sample, lean_sample  # noqa: E402
from tests.helpers import arithmetic_examples, digit_share, make_config  # noqa: E402
from tests.train.test_resume import check_resume_is_exact  # noqa: E402

TOL = 1e-5  # two float32 paths over the same effective weights (module docstring)
MOVED = 1e-2  # the random adapter moves every compared log-prob by more than this
LORA = {"model.lora.rank": 2, "model.lora.alpha": 4.0}


def _plain(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _adapted(path, rank=2, seed=0):
    """The tiny model with LoRA on every linear layer and a random B (peft starts B at zero, where
    the adapted model equals the base and no test could tell them apart)."""
    model = _plain(path)
    lora = add_lora(model, SimpleNamespace(rank=rank, alpha=4.0, target_modules="all-linear", dropout=0.0), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval(), lora


@pytest.fixture(scope="module")
def contexts(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [tokenizer.encode(row["prompt"]) for row in arithmetic_examples(4, seed=5) for _ in range(3)]
    ids, mask = pad(prompts, tokenizer.pad_token_id, left=True)
    return tokenizer, ids, mask


def _log_probs(model, ids, mask, tokens, keep):
    return batched_log_probs(model, ids, mask, tokens, keep, 1.0, chunk=64)


def test_merged_weights_are_the_adapted_models_effective_weights(tiny_model, contexts):
    tokenizer, ids, mask = contexts
    adapted, _ = _adapted(tiny_model)
    before = {name: tensor.clone() for name, tensor in adapted.state_dict().items()}
    merged = merged_weights(adapted)
    base = _plain(tiny_model)
    assert set(merged) == set(base.state_dict())  # the base's own names: what vLLM and save_pretrained take
    # not merged in place: every tensor of the trained model is as it was (the same tensors, read back)
    assert all(torch.equal(before[name], tensor) for name, tensor in adapted.state_dict().items())
    # W + s * B @ A from the adapter's own tensors, in float64 (the definition)
    layer = adapted.model.layers[0].self_attn.q_proj
    delta = layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double() * (4.0 / 2)
    expected = layer.base_layer.weight.double() + delta
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"].double(), expected, atol=1e-6, rtol=0)
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.bias"], layer.base_layer.bias)  # biases untouched

    torch.manual_seed(0)
    tokens = lean_sample(adapted, ids, mask, 8, SamplingParams(), [tokenizer.eos_token_id], tokenizer.pad_token_id)
    keep = tokens.tokens != tokenizer.pad_token_id
    base_lp = _log_probs(base, ids, mask, tokens.tokens, keep)
    base.load_state_dict(merged)
    adapted_lp = _log_probs(adapted, ids, mask, tokens.tokens, keep)
    merged_lp = _log_probs(base, ids, mask, tokens.tokens, keep)
    assert (merged_lp - adapted_lp)[keep].abs().max() < TOL
    assert (base_lp - adapted_lp)[keep].abs().min() > MOVED * 1e-3 and (base_lp - adapted_lp)[keep].abs().max() > MOVED


def test_disabled_adapters_give_the_base_weights(tiny_model):
    adapted, lora = _adapted(tiny_model)
    base = _plain(tiny_model).state_dict()
    with lora.disable_adapter():
        merged = merged_weights(adapted)
    assert all(torch.equal(merged[name], base[name]) for name in base)


def test_the_rollout_samplers_draw_from_the_adapted_model(tiny_model, contexts):
    """Both HF-side samplers run the model with its adapters: the lean loop's own log-probs are the
    adapted model's (those of the merged weights), and generate draws the tokens the merged model
    draws with the same seed. (Tokens: the two forwards differ by ~1e-7 in a log-prob, so a draw
    could flip only where a uniform sample falls within ~1e-7 of a CDF edge: odds ~1e-5 here.)"""
    tokenizer, ids, mask = contexts
    eos, pad_id, params = [tokenizer.eos_token_id], tokenizer.pad_token_id, SamplingParams()
    adapted, _ = _adapted(tiny_model)
    merged, base = _plain(tiny_model), _plain(tiny_model)
    merged.load_state_dict(merged_weights(adapted))

    torch.manual_seed(3)
    lean = lean_sample(adapted, ids, mask, 8, params, eos, pad_id)
    keep = lean.tokens != pad_id
    keep[:, 0] = True
    assert (lean.log_prob - _log_probs(merged, ids, mask, lean.tokens, keep))[keep].abs().max() < TOL
    assert (lean.log_prob - _log_probs(base, ids, mask, lean.tokens, keep))[keep].abs().max() > MOVED

    draws = {}
    for name, model in (("adapted", adapted), ("merged", merged), ("base", base)):
        torch.manual_seed(4)
        draws[name] = hf_sample(model, ids, mask, 8, params, eos, pad_id).tokens
    assert torch.equal(draws["adapted"], draws["merged"])
    assert not torch.equal(draws["adapted"], draws["base"])


def test_a_lora_run_trains_the_adapters_only_and_takes_its_kl_reference_from_the_base(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **LORA, **{"loss.kl_coef": 0.1})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    try:
        assert trainer.ref_model is None  # no second copy of the model
        adapters = {name for name, param in trainer.model.named_parameters() if param.requires_grad}
        assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
        optimized = {id(param) for group in trainer.optimizer.param_groups for param in group["params"]}
        assert optimized == {id(param) for name, param in trainer.model.named_parameters() if name in adapters}
        frozen = {name: param.clone() for name, param in trainer.model.named_parameters() if name not in adapters}
        for _ in range(2):
            batch, _ = trainer.rollout_step()
            rows = trainer.update_step(batch)
        assert not rows[-1]["skipped"] and "kl_loss" in rows[-1]
        params = dict(trainer.model.named_parameters())
        assert all(torch.equal(value, params[name]) for name, value in frozen.items())

        batch, _ = trainer.rollout_step()  # after 2 updates: the policy has moved away from the base
        keep = batch.response_mask
        base = _plain(tiny_model)
        args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, keep)
        assert (batch.ref_log_prob - _log_probs(base, *args))[keep].abs().max() < TOL
        assert (batch.ref_log_prob - batch.old_log_prob)[keep].abs().max() > 1e-4  # the adapters were on for these
        policy = _plain(tiny_model)
        policy.load_state_dict(merged_weights(trainer.model))
        assert (batch.old_log_prob - _log_probs(policy, *args))[keep].abs().max() < TOL
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "extra",
    [
        {"offpolicy.async_delay": 1, "loss.kl_coef": 0.05},
        {"loss.method": "bapo", "offpolicy.mini_batches": 2, "optim.micro_batch_size": 6},
        {"loss.method": "grpo", "offpolicy.mini_batches": 2, "optim.micro_batch_size": 6, "model.lora.dropout": 0.1},
    ],
    ids=["fifo-kl", "bapo-minibatch", "grpo-minibatch-dropout"],
)
def test_lora_resume_is_exact(tiny_model, tmp_path, extra):
    """The adapter (fp32 safetensors) and the optimizer state over the adapters are restored onto the
    same frozen base: the resumed run computes what the uninterrupted one did, update for update
    (the same code path on both sides, so the rows are equal, as in tests/train/test_resume.py)."""
    check_resume_is_exact(tiny_model, tmp_path, {**LORA, **extra})


def test_lora_checkpoint_holds_the_adapter_and_the_merged_model_and_bapo_eval_reads_it(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from bapo.cli.main import app

    examples = arithmetic_examples(16)
    cfg = make_config(tiny_model, tmp_path / "run", **LORA, **{"run.rollout_steps": 2, "run.checkpoint_every": 2})
    trainer = Trainer(cfg, examples=examples, verifier=digit_share)
    trainer.fit()
    checkpoint = tmp_path / "run" / "checkpoints" / "update_000002"
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    saved = _plain(checkpoint / "model")  # a plain HF model folder: the merged weights
    ids, mask = pad([trainer.tokenizer.encode("3+4=12")] * 2, 0, left=True)
    with torch.no_grad():
        trained = trainer.model(input_ids=ids, attention_mask=mask.long()).logits
        loaded = saved(input_ids=ids, attention_mask=mask.long()).logits
        initial = _plain(tiny_model)(input_ids=ids, attention_mask=mask.long()).logits
    assert (trained - loaded).abs().max() < TOL and (trained - initial).abs().max() > 1e-4

    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in examples[:3]))
    result = CliRunner().invoke(app, ["eval", "--model", str(tmp_path / "run"), "--data", str(data), "--k", "2"])
    assert result.exit_code == 0, result.output
    scores = json.loads(result.output.strip().splitlines()[-1])
    assert scores["model"] == str(checkpoint / "model") and scores["sampling/max_new_tokens"] == 8


def test_lora_dropout_acts_in_the_forwards_with_grad_only_and_is_refused_with_bapo(tiny_model, tmp_path):
    """The update's no-grad forwards (BAPO's pre-pass, proximal and reference log-probs) read the policy
    without dropout; the loss's forward with grad draws it. With BAPO the search would then see other
    ratios than its loss, so that pair is refused in one line."""
    from bapo.train import ConfigError
    from bapo.train.update import _forward

    cfg = make_config(tiny_model, tmp_path / "run", **LORA, **{"model.lora.dropout": 0.5})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    batch, _ = trainer.rollout_step()
    with torch.no_grad():  # B = 0 at init would hide any dropout: as after some training
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            first, _ = _forward(trainer.model, batch, cfg, with_entropy=False)
            again, _ = _forward(trainer.model, batch, cfg, with_entropy=False)
        with_grad, _ = _forward(trainer.model, batch, cfg, with_entropy=False)
        mask = batch.response_mask
        assert torch.equal(first[mask], again[mask])  # no dropout draw: the same forward twice
        assert (with_grad.detach() - first)[mask].abs().max() > 1e-4  # dropout 0.5 drew masks
    finally:
        trainer.close()
    with pytest.raises(ConfigError, match="model.lora.dropout=0.5 with loss.method=bapo"):
        make_config(tiny_model, tmp_path / "bapo", **LORA, **{"model.lora.dropout": 0.5, "loss.method": "bapo"})


def test_lora_dropout_runs_in_the_update_forward_only(tiny_model):
    model = _plain(tiny_model)
    add_lora(model, SimpleNamespace(rank=2, alpha=4.0, target_modules="all-linear", dropout=0.5), 0)
    model.eval()
    dropouts = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name]
    assert dropouts and not any(m.training for m in dropouts)
    with adapter_dropout(model):
        assert all(m.training for m in dropouts)
        assert not model.model.layers[0].self_attn.training  # the rest of the model stays in eval mode
    assert not any(m.training for m in dropouts)


def test_lora_init_is_seeded_and_leaves_the_run_rng_alone(tiny_model):
    section = SimpleNamespace(rank=2, alpha=4.0, target_modules="all-linear", dropout=0.0)
    torch.manual_seed(123)
    random.seed(1)
    np.random.seed(1)
    state = torch.get_rng_state()
    first, second = _plain(tiny_model), _plain(tiny_model)
    add_lora(first, section, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)  # another global state: the init depends on the seed only
    add_lora(second, section, seed=7)
    a = dict(first.named_parameters())
    assert all(torch.equal(a[name], param) for name, param in second.named_parameters() if "lora_A" in name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.alpha=8"], "model.lora.alpha is set but model.lora.rank is null"),
        (["model.lora.rank=0"], "model.lora.rank: Input should be greater than 0"),
        (["model.lora.rank=2", "model.lora.target_modules=[]"], "model.lora.target_modules: no module named"),
        (["model.lora.rank=2", "model.lora.dropout=1"], "model.lora.dropout: Input should be less than 1"),
        (["model.lora.rnak=2"], "did you mean 'model.lora.rank'"),
    ],
)
def test_bad_lora_config_fails_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, ["model.path=x", *overrides])
    assert "\n" not in str(err.value)


def test_lora_config_values():
    cfg = load_config(None, ["model.path=x", "model.lora.rank=4", "model.lora.target_modules=q_proj,v_proj"])
    assert cfg.model.lora.rank == 4 and cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(None, ["model.path=x"]).model.lora.rank is None  # off by default
    from bapo.train.config_io import describe_config

    text = describe_config(None, ["model.path=x"])
    assert "  lora:" in text and "    rank: null  # LoRA rank" in text and "all-linear" in text


def test_unknown_target_module_fails_in_one_line_at_start(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"model.lora.rank": 2, "model.lora.target_modules": ["qq_proj"]})
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['qq_proj'\]") as err:
        Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    assert "\n" not in str(err.value)


def test_full_fine_tune_is_unchanged_without_lora(tiny_model, tmp_path):
    """model.lora off: every weight trains and the checkpoint holds no adapter."""
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 1, "run.checkpoint_every": 1})
    run = train(cfg, examples=arithmetic_examples(), verifier=digit_share)
    assert len(read_metrics(run)) == 1
    assert (run / "checkpoints" / "update_000001" / "model").is_dir()
    assert not (run / "checkpoints" / "update_000001" / "adapter").exists()


def test_the_lora_vs_full_example_differs_from_its_full_run_in_lora_and_lr_only():
    """examples/configs/smollm2_lora_grpo.yaml: the LoRA arm and its full fine-tune arm (model.lora=null
    optim.lr=1e-5, the header's command) are the same run but for the adapter and the learning rate."""
    path, model = "examples/configs/smollm2_lora_grpo.yaml", "model.path=x"
    lora = load_config(path, [model]).model_dump()
    full = load_config(path, [model, "model.lora=null", "optim.lr=1e-5"]).model_dump()
    assert lora["model"]["lora"]["rank"] == 1 and full["model"]["lora"]["rank"] is None
    assert lora["optim"]["lr"] == pytest.approx(10 * full["optim"]["lr"])
    for config in (lora, full):
        config["model"].pop("lora"), config["optim"].pop("lr")
    assert lora == full


def test_lora_trains_under_gradient_checkpointing(tiny_model, tmp_path):
    """The adapters inside checkpointed blocks get gradient. (With reentrant checkpointing, the
    default of older transformers, frozen embeddings would leave the blocks' inputs without grad and
    the adapters without gradient, which the trainer's enable_input_require_grads prevents;
    transformers 5 checkpoints non-reentrantly, where this holds either way.)"""
    cfg = make_config(tiny_model, tmp_path / "run", **LORA, **{"model.gradient_checkpointing": True})
    trainer = Trainer(cfg, examples=arithmetic_examples(), verifier=digit_share)
    try:
        batch, _ = trainer.rollout_step()
        rows = trainer.update_step(batch)
        moved = [param.abs().max().item() for name, param in trainer.model.named_parameters() if "lora_B" in name]
        assert not rows[-1]["skipped"] and rows[-1]["grad_norm"] > 0 and min(moved) > 0  # B starts at zero
    finally:
        trainer.close()


def test_a_saved_config_with_every_lora_key_at_its_default_loads(tmp_path):
    """A run's config.yaml writes every key out (model.lora.alpha: 32.0 with rank null): that is
    LoRA off, not a half-set section."""
    from bapo.train.config_io import config_from_dict

    saved = load_config(None, ["model.path=x"]).model_dump(mode="json")
    assert config_from_dict(saved).model.lora.rank is None
