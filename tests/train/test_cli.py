import json

import yaml
from typer.testing import CliRunner

from bapo.cli.main import app
from bapo.train import read_metrics
from tests.helpers import arithmetic_examples


def write_setup(tiny_model, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_examples(16)))
    config = {"model": {"path": tiny_model, "device": "cpu"}, "data": {"path": str(data)},
              "rollout": {"prompts_per_batch": 2, "group_size": 4, "max_new_tokens": 6},
              "reward": {"verifier": "format", "format_pattern": "[0-4]"},
              "run": {"output_dir": str(tmp_path / "run"), "steps": 2, "progress": True, "tensorboard": "on"}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_bapo_train_runs_then_resumes(tiny_model, tmp_path):
    config = write_setup(tiny_model, tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(config), "loss.method=bapo", "offpolicy.staleness=1"])
    assert result.exit_code == 0, result.output
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all("upper" in r for r in rows)
    assert list((tmp_path / "run" / "tensorboard").iterdir())
    # continue the same run for two more steps
    result = runner.invoke(app, ["train", "--resume", str(tmp_path / "run"), "run.steps=4"])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]


def test_bapo_train_reports_config_errors(tiny_model, tmp_path):
    config = write_setup(tiny_model, tmp_path)
    result = CliRunner().invoke(app, ["train", str(config), "loss.mehtod=bapo"])
    assert result.exit_code == 2
    assert "did you mean 'loss.method'" in result.output
    result = CliRunner().invoke(app, ["train", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "not found" in result.output


def test_a_partial_last_line_from_a_kill_is_skipped_on_read_and_resume(tmp_path):
    from bapo.train.metrics import MetricsLog

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": "nan"}\n{"step": 2, "loss": 0.25}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    log = MetricsLog(tmp_path, tensorboard="off", resume_step=2)
    log.write({"step": 3, "loss": float("inf")})
    log.close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": "nan"}, {"step": 2, "loss": 0.25}, {"step": 3, "loss": "inf"}]
