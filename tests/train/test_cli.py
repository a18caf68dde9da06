import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from bapo.cli.main import app
from bapo.train import read_metrics
from bapo.train.checkpoint import checkpoints
from tests.helpers import arithmetic_examples, make_config


def write_setup(tiny_model, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_examples(16)))
    config = {
        "model": {"path": tiny_model, "device": "cpu"},
        "data": {"path": str(data)},
        "rollout": {"prompts_per_batch": 2, "group_size": 4, "max_new_tokens": 6},
        "reward": {"verifier": "format", "format_pattern": "[0-4]"},
        "run": {"output_dir": str(tmp_path / "run"), "rollout_steps": 2, "progress": True, "tensorboard": "on"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_bapo_train_runs_then_resumes(tiny_model, tmp_path):
    config = write_setup(tiny_model, tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(config), "loss.method=bapo", "offpolicy.async_delay=1"])
    assert result.exit_code == 0, result.output
    rows = read_metrics(tmp_path / "run")
    assert [r["update"] for r in rows] == [1, 2] and all("upper" in r for r in rows)
    assert list((tmp_path / "run" / "tensorboard").iterdir())
    # continue the same run for two more steps
    result = runner.invoke(app, ["train", "--resume", str(tmp_path / "run"), "run.rollout_steps=4"])
    assert result.exit_code == 0, result.output
    assert [r["update"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]


def test_bapo_train_reports_config_errors(tiny_model, tmp_path):
    config = write_setup(tiny_model, tmp_path)
    result = CliRunner().invoke(app, ["train", str(config), "loss.mehtod=bapo"])
    assert result.exit_code == 2
    assert "did you mean 'loss.method'" in result.output
    result = CliRunner().invoke(app, ["train", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "not found" in result.output


def test_a_partial_last_line_from_a_kill_is_skipped_on_read_and_resume(tmp_path):
    from bapo.train.metrics import MetricsLog

    (tmp_path / "metrics.jsonl").write_text(
        '{"update": 1, "loss": "nan"}\n{"update": 2, "loss": 0.25}\n{"update": 3, "lo'
    )
    assert [row["update"] for row in read_metrics(tmp_path)] == [1, 2]
    log = MetricsLog(tmp_path, tensorboard="off", resume_update=2)
    log.write({"update": 3, "loss": float("inf")})
    log.close()
    assert read_metrics(tmp_path) == [
        {"update": 1, "loss": "nan"},
        {"update": 2, "loss": 0.25},
        {"update": 3, "loss": "inf"},
    ]


def test_the_old_run_steps_key_fails_naming_its_new_name():
    from bapo.train.config import ConfigError
    from bapo.train.config_io import load_config

    with pytest.raises(ConfigError, match=r"^run\.steps was renamed run\.rollout_steps") as err:
        load_config(None, ["run.steps=3"])
    assert "\n" not in str(err.value)
    assert load_config(None, ["model.path=m", "run.rollout_steps=3"]).run.rollout_steps == 3


def test_the_old_offpolicy_staleness_key_is_refused_naming_async_delay_and_E(tmp_path):
    """offpolicy.staleness was the async delay k; a reader of the paper means E by it, so it is
    refused (override, config file, command line), never read as either."""
    from bapo.train.config import ConfigError
    from bapo.train.config_io import load_config

    why = r"\(it was the async delay k; the paper's staleness E is offpolicy\.mini_batches x offpolicy\.epochs - 1\)"
    with pytest.raises(ConfigError, match=r"^offpolicy\.staleness was renamed offpolicy\.async_delay") as err:
        load_config(None, ["model.path=m", "offpolicy.staleness=2"])
    assert re.search(r"\[command-line override\]: write offpolicy\.async_delay instead " + why + "$", str(err.value))
    config = tmp_path / "config.yaml"
    config.write_text("model: {path: m}\noffpolicy:\n  staleness: 2\n")
    with pytest.raises(ConfigError, match=rf"offpolicy\.async_delay \[{re.escape(str(config))} line 3\]: .*{why}$"):
        load_config(config)
    line = one_line_error(CliRunner().invoke(app, ["train", str(config)]))
    assert "offpolicy.staleness was renamed offpolicy.async_delay" in line and "offpolicy.mini_batches" in line
    assert load_config(None, ["model.path=m", "offpolicy.async_delay=2"]).offpolicy.async_delay == 2


def test_bapo_train_resumes_a_run_folder_written_before_the_renames(tiny_model, tmp_path):
    """A run folder written before checkpoints/step_N became update_N and offpolicy.staleness became
    offpolicy.async_delay (its config.yaml) resumes from `bapo train --resume` alone: its own
    records are read under the new names (checkpoint.py and config_io.upgrade_run_config)."""
    config = write_setup(tiny_model, tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(config), "offpolicy.async_delay=1", "run.checkpoint_every=1"])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "run"
    for checkpoint in (run_dir / "checkpoints").glob("update_*"):
        checkpoint.rename(checkpoint.with_name(checkpoint.name.replace("update_", "step_")))
    saved = (run_dir / "config.yaml").read_text()
    assert "  async_delay: 1\n" in saved
    (run_dir / "config.yaml").write_text(saved.replace("  async_delay: 1\n", "  staleness: 1\n"))
    result = runner.invoke(app, ["train", "--resume", str(run_dir), "run.rollout_steps=3"])
    assert result.exit_code == 0, result.output
    assert [r["update"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert [c.name for c in checkpoints(run_dir)] == ["update_000003", "step_000002"]  # by updates, old and new


# -- errors: one line naming the field, the file and line, and the fix; exit code 2 -------------
def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def good_rows() -> str:
    return "".join(json.dumps(row) + "\n" for row in arithmetic_examples(8))


def good_data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(good_rows())
    return path


def test_missing_model_path_is_one_line(tmp_path):
    line = one_line_error(CliRunner().invoke(app, ["train", f"data.path={good_data(tmp_path)}"]))
    assert "model.path is not set" in line and "model.path=DIR" in line


def test_nonexistent_model_path_without_a_config_file_is_one_line(tmp_path):
    """`bapo train model.path=X ...`: the key=value arguments are overrides, not a config file."""
    missing = tmp_path / "no" / "such-model"
    line = train_on_data(str(missing), tmp_path, good_rows())[1]
    assert f"model.path='{missing}': no such folder" in line and "Hugging Face id" in line


def test_model_folder_without_config_json_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in train_on_data(str(tmp_path / "empty"), tmp_path, good_rows())[1]


def train_on_data(model: str, tmp_path, text: str) -> tuple[str, str]:
    """`bapo train model.path=M data.path=F` on a data file holding `text` -> (F, its one error line)."""
    data = tmp_path / "data.jsonl"
    data.write_text(text)
    result = CliRunner().invoke(
        app, ["train", f"model.path={model}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    )
    return str(data), one_line_error(result)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            '{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"\n',
            "{data} line 3: not valid JSON",
        ),  # 1-based, blank lines count
        ("\n", "{data}: the file holds no rows; add one object per line"),
        (
            '{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n',
            "{data} line 2: no key 'prompt' (data.prompt_key); the row has ['answer', 'question']",
        ),
        ('["1+1=", "2"]\n', "{data} line 1: a row must be a JSON object, got list"),
        ('{"prompt": [1, 2], "answer": 3}\n', "{data} line 1: 'prompt' must be a non-empty string (the prompt text)"),
        ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": " ", "answer": "2"}\n', "{data} line 2: 'prompt' must be"),
        ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', "{data} line 2: no key 'answer' (data.answer_key)"),
        ('{"prompt": "1+1=", "answer": [2]}\n', "{data} line 1: 'answer' must be a string or a number"),
        ('{"prompt": "1+1=", "answer": null}\n', "{data} line 1: 'answer' must be a string or a number"),
    ],
)
def test_bad_data_file_names_file_and_1_based_line(tiny_model, tmp_path, text, expected):
    data, line = train_on_data(tiny_model, tmp_path, text)
    assert expected.format(data=f"data.path={data}") in line


def test_data_file_that_is_not_utf8_names_the_line(tiny_model, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\u00e9", "answer": "2"}\n'.encode("latin-1"))
    result = CliRunner().invoke(app, ["train", f"model.path={tiny_model}", f"data.path={data}"])
    assert f"data.path={data} line 2: not UTF-8 (byte 0xe9" in one_line_error(result)


def test_data_file_with_a_byte_order_mark_loads(tmp_path):
    from bapo.train.config import DataSection
    from bapo.train.data import load_examples

    data = tmp_path / "bom.jsonl"
    data.write_bytes('{"prompt": "1+1=", "answer": "2"}\n'.encode("utf-8-sig"))
    assert load_examples(DataSection(path=str(data)), needs_answer=True) == [{"prompt": "1+1=", "answer": "2"}]


def test_bad_rows_passed_to_train_are_one_line(tiny_model, tmp_path):
    from bapo.train import ConfigError, train

    cfg = make_config(tiny_model, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"examples row 2: 'prompt' must be a non-empty string"):
        train(cfg, examples=[{"prompt": "1+1=", "answer": "2"}, {"prompt": 7, "answer": "2"}])
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.device=nonsense", "model.device: not a torch device"),
        ("reward.format_pattern=(", "reward.format_pattern: not a regular expression"),
        ('rollout.stop=[""]', "rollout.stop: an empty string would end every response at once"),
        ("reward.correct_threshold=nan", "reward.correct_threshold: Input should be a finite number"),
        ("optim.lr=inf", "optim.lr: Input should be a finite number"),
        ("loss.bapo.preset=[]", "loss.bapo.preset: Input should be 'default', 'paper' or 'recipe'"),
    ],
)
def test_bad_config_values_are_one_line(tmp_path, override, expected):
    result = CliRunner().invoke(app, ["train", "model.path=m", f"data.path={good_data(tmp_path)}", override])
    assert expected in one_line_error(result)


def test_a_cuda_device_on_a_machine_without_one_is_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(app, ["train", "model.path=m", f"data.path={good_data(tmp_path)}", "model.device=cuda"])
    assert "model.device: this machine has no CUDA" in one_line_error(result)


def test_bad_config_value_names_file_and_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  path: m\nrollout:\n  temperature: -1\n")
    line = one_line_error(CliRunner().invoke(app, ["train", str(config)]))
    assert "rollout.temperature" in line and f"{config} line 4" in line


def test_stray_argument_is_one_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  path: m\n")
    line = one_line_error(CliRunner().invoke(app, ["train", str(config), "loss.method"]))
    assert "'loss.method' is not key=value" in line


def test_debug_flag_and_env_show_the_traceback(tmp_path, monkeypatch):
    from bapo.train import ConfigError

    monkeypatch.setenv("BAPO_DEBUG", "0")  # --debug sets it for the process: restored after
    args = ["train", f"data.path={good_data(tmp_path)}"]
    result = CliRunner().invoke(app, ["--debug"] + args)
    assert isinstance(result.exception, ConfigError) and "model.path is not set" in str(result.exception)
    monkeypatch.setenv("BAPO_DEBUG", "0")
    assert CliRunner().invoke(app, args).exit_code == 2
    monkeypatch.setenv("BAPO_DEBUG", "1")
    assert isinstance(CliRunner().invoke(app, args).exception, ConfigError)


# -- CLI habits ---------------------------------------------------------------------------------
def test_python_m_bapo_and_help_describe_the_tool():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    out = subprocess.run(
        [sys.executable, "-m", "bapo", "--help"], capture_output=True, text=True, env=env, check=False, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "Stable off-policy RL for language models" in out.stdout and "--print-config" in out.stdout


def test_print_config_resolves_file_and_overrides(tmp_path):
    result = CliRunner().invoke(
        app,
        ["train", "--print-config", "examples/configs/bapo_math.yaml", "run.tensorboard=off", "loss.bapo.target=0.5"],
    )
    assert result.exit_code == 0, result.output
    assert "  tensorboard: 'off'" in result.output and "    target: 0.5" in result.output
    assert "(default 0.4)" in result.output and "positive share to reach" in result.output
    bare = CliRunner().invoke(app, ["train", "--print-config"])
    assert bare.exit_code == 0 and "  path: null" in bare.output and "(required)" in bare.output


def test_eval_of_a_run_dir_uses_its_latest_checkpoint_and_settings(tiny_model, tmp_path):
    config = write_setup(tiny_model, tmp_path)
    runner = CliRunner()
    assert (
        runner.invoke(
            app,
            [
                "train",
                str(config),
                "run.progress=false",
                "rollout.temperature=0.7",
                "rollout.top_k=5",
                "data.system_prompt=q: ",
            ],
        ).exit_code
        == 0
    )
    eval_args = [
        "eval",
        "--model",
        str(tmp_path / "run"),
        "--data",
        str(tmp_path / "train.jsonl"),
        "--k",
        "2",
        "--limit",
        "3",
        "--seed",
        "1",
    ]
    result = runner.invoke(app, eval_args)
    assert result.exit_code == 0, result.output
    scores = json.loads(result.output.strip().splitlines()[-1])
    assert scores["model"].endswith("checkpoints/update_000002/model") or scores["model"].endswith("/model")
    assert scores["sampling/temperature"] == 0.7 and scores["sampling/top_k"] == 5
    assert scores["sampling/system_prompt"] == "q: " and scores["sampling/max_new_tokens"] == 6
    assert 0 < scores["response_length/mean_tokens"] <= 6 and scores["seed"] == 1
    again = runner.invoke(app, [*eval_args, "--temperature", "0"])
    assert json.loads(again.output.strip().splitlines()[-1])["sampling/temperature"] == 0.0
    missing = runner.invoke(
        app, ["eval", "--model", str(tmp_path / "nope" / "x"), "--data", str(tmp_path / "train.jsonl")]
    )
    assert "--model " in one_line_error(missing)


def without_vllm(monkeypatch):
    """This Python as if vLLM were not installed (the check looks it up with importlib.util.find_spec)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))


def test_vllm_backend_without_vllm_is_one_line_before_any_work(tiny_model, tmp_path, monkeypatch):
    without_vllm(monkeypatch)
    run_dir = tmp_path / "run"
    args = ["train", f"model.path={tiny_model}", f"data.path={good_data(tmp_path)}", f"run.output_dir={run_dir}"]
    line = one_line_error(CliRunner().invoke(app, [*args, "rollout.backend=vllm"]))
    assert "rollout.backend=vllm: vLLM is not installed" in line
    assert "`make vllm`" in line and ".venv/bin/bapo train" in line and "pip install vllm" in line
    assert not run_dir.exists()  # nothing written, no model loaded


def test_a_trainer_built_directly_gets_the_same_line_at_its_first_vllm_rollout(tiny_model, tmp_path, monkeypatch):
    import builtins

    from bapo.train import ConfigError, Trainer

    without_vllm(monkeypatch)
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    cfg = make_config(tiny_model, tmp_path / "run", **{"rollout.backend": "vllm"})
    trainer = Trainer(cfg, examples=arithmetic_examples())
    with pytest.raises(ConfigError, match=r"rollout.backend=vllm: vLLM is not installed .*make vllm"):
        trainer.rollout_step()
    trainer.close()
