import json

import pytest
from typer.testing import CliRunner

from bapo.analysis.evaluate import evaluate, pass_at_k
from bapo.cli.eval_cmd import eval_verifier
from bapo.cli.main import app
from bapo.experiments.task import verify
from bapo.train.data import read_jsonl


def test_pass_at_k_estimator():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)


def test_evaluate_counts_per_sample(tiny_model_dir, heldout_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = read_jsonl(heldout_file)
    seen = []

    def every_other(response, row):  # correct for samples 0, 2, 4, ... in call order
        seen.append(response)
        return float(len(seen) % 2 == 1)

    scores = evaluate(model, tok, rows, k=4, verifier=every_other, max_new_tokens=6)
    assert len(seen) == 4 * len(rows)
    assert scores["avg@4"] == pytest.approx(0.5) and scores["pass@4"] == 1.0
    assert all(len(tok(s, add_special_tokens=False)["input_ids"]) <= 6 for s in seen)
    never = evaluate(model, tok, rows, k=2, verifier=lambda r, x: 0.0, max_new_tokens=4)
    assert never["avg@2"] == 0.0 and never["pass@2"] == 0.0


def test_auto_verifier_picks_demo_for_demo_rows():
    rows = [{"prompt": "3,5,9>4:", "answer": "9-5"}]
    assert eval_verifier("auto", rows) is verify
    assert eval_verifier("auto", [{"prompt": "What is 1+2?", "answer": "3"}]) is not verify


def test_bapo_eval_cli(tiny_model_dir, heldout_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import digit_share

    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(heldout_file),
            "--k",
            "3",
            "--max-new-tokens",
            "8",
            "--verifier",
            "tests.helpers:digit_share",
        ],
    )
    assert result.exit_code == 0, result.output
    scores = json.loads(result.output.strip().splitlines()[-1])
    assert set(scores) >= {"avg@3", "pass@3", "n"} and scores["n"] == 6
    # the command passes model, rows, k, length and verifier through: the same numbers as a direct call
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    direct = evaluate(model, tokenizer, read_jsonl(heldout_file), k=3, verifier=digit_share, max_new_tokens=8)
    # (the command also reports the model and the sampling settings it used)
    assert {key: scores[key] for key in direct} == pytest.approx(direct) and direct["avg@3"] > 0
