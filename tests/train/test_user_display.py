"""What a user sees while training runs: progress lines, no-signal warnings, metric sinks, and
the start-up check of the tokenizer's special tokens."""

import json
import shutil

import pytest

from bapo.train import read_metrics, train
from bapo.train.metrics import NoSignalWarning, PlainProgress
from tests.helpers import arithmetic_examples, digit_share, make_config


def row(update, zero=0, truncated=0.5, reward=0.3):
    return {
        "update": update,
        "groups/zero_variance": zero,
        "rollout/response_length/truncated_frac": truncated,
        "rollout/reward/mean": reward,
    }


def test_no_signal_warning_names_the_cause_and_repeats_once_per_n_updates():
    warn = NoSignalWarning(groups_per_batch=4, every=3)
    assert warn.check(row(1, zero=3)) is None  # some groups still carry signal
    message = warn.check(row(2, zero=4))
    assert "update 2" in message and "same reward" in message and "\\boxed{}" in message
    assert warn.check(row(3, zero=4)) is None and warn.check(row(4, zero=4)) is None  # within 3 updates
    assert "rollout.max_new_tokens" in warn.check(row(5, truncated=1.0))
    assert NoSignalWarning(4, every=0).check(row(9, zero=4)) is None  # 0 = never


def test_plain_progress_prints_one_line_per_update_with_eta():
    import io

    out = io.StringIO()
    progress = PlainProgress(total=4, stream=out)
    progress.status("warm-up rollout 1/2: async delay 2 generates its first batches before the first update")
    progress.status("rollout step 1: sampling 4 x 4 responses")  # only warm-up is printed: updates have lines
    progress(
        1,
        4,
        {
            "reward/mean": 0.25,
            "accuracy": 0.5,
            "entropy": 1.5,
            "lower": 0.8,
            "upper": 1.2,
            "positive_share": 0.45,
            "tokens_per_s": 321.0,
        },
    )
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("warm-up rollout 1/2") and len(lines) == 2
    assert lines[1].startswith(
        "update 1/4  reward 0.250  acc 0.500  entropy 1.500  bounds [0.80, 1.20]  share 0.450  tok/s 321  eta "
    )


def test_training_without_a_terminal_prints_warm_up_and_update_lines(tiny_model, tmp_path, capsys):
    cfg = make_config(
        tiny_model,
        tmp_path / "run",
        **{"offpolicy.async_delay": 2, "run.rollout_steps": 2, "run.progress": "true", "loss.method": "bapo"},
    )
    train(cfg, examples=arithmetic_examples(), verifier=digit_share)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["warm-up rollout 1/2", "warm-up rollout 2/2"]
    updates = [line for line in lines if line.startswith("update ")]
    assert [u.split()[1] for u in updates] == ["1/2", "2/2"]
    assert all("bounds [" in u and "eta " in u and "nan" not in u.split("eta")[0] for u in updates)


def test_a_batch_without_reward_variance_warns_during_training(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 3, "run.no_signal_every": 5})
    with pytest.warns(UserWarning, match="no learning signal.*same reward") as record:
        train(cfg, examples=arithmetic_examples(), verifier=lambda response, example: 1.0)
    assert sum("no learning signal" in str(w.message) for w in record) == 1  # once per 5 updates


def test_wandb_offline_logs_the_run_and_resume_continues_the_same_run(tiny_model, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    cfg = make_config(
        tiny_model, run, **{"run.report_to": "[jsonl, wandb]", "run.rollout_steps": 2, "run.checkpoint_every": 1}
    )
    train(cfg, examples=arithmetic_examples(), verifier=digit_share)
    run_id = (run / "wandb_id").read_text()
    first = list((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(first) == 1 and first[0].stat().st_size > 0
    assert not (run / "tensorboard").exists()  # not listed in report_to
    cfg = make_config(tiny_model, run, **{"run.report_to": "[jsonl, wandb]", "run.rollout_steps": 3})
    train(cfg, examples=arithmetic_examples(), verifier=digit_share, resume=run)
    assert (run / "wandb_id").read_text() == run_id
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
    assert [r["update"] for r in read_metrics(run)] == [1, 2, 3]


def test_special_token_mismatch_warns_at_start_up(tiny_model, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from bapo.train import Trainer
    from bapo.train.data import special_token_warnings

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert special_token_warnings(tok, GenerationConfig(eos_token_id=tok.eos_token_id)) == []
    messages = special_token_warnings(tok, GenerationConfig(eos_token_id=[5], pad_token_id=7))
    assert "eos_token='<eos>' (id 1) differs from generation_config.eos_token_id=[5]" in messages[0]
    assert "pad_token_id=0 differs" in messages[1]

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    gen = (
        json.loads((model / "generation_config.json").read_text())
        if (model / "generation_config.json").exists()
        else {}
    )
    (model / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=5)))
    with pytest.warns(UserWarning, match="generation_config.eos_token_id=5"):
        Trainer(make_config(str(model), tmp_path / "run"), examples=arithmetic_examples(), verifier=digit_share)


def test_wandb_listed_but_missing_is_a_config_error(tmp_path, monkeypatch):
    import sys

    from bapo.train import ConfigError
    from bapo.train.metrics import MetricsLog

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match="run.report_to lists wandb, which is not installed"):
        MetricsLog(tmp_path, tensorboard="off", report_to=("jsonl", "wandb"))
