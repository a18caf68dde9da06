"""Two rollout steps of the whole demo pipeline on a tiny warm start: every output file appears,
and a run is deterministic per seed."""

import json
from dataclasses import replace

import pytest

from bapo.analysis.plots import FIGURES
from bapo.experiments.demo import PROFILES, DemoPlan, run_demo, train_config
from bapo.experiments.harness import RunSpec, cache_root
from bapo.experiments.task import TaskConfig
from bapo.experiments.warmstart import SFTConfig, WarmStartConfig, warm_start
from bapo.train.tiny import ModelConfig


def read_json(path):
    return json.loads(path.read_text())


TINY = WarmStartConfig(
    task=TaskConfig(n_train=64, n_heldout=8, max_new_tokens=8),
    model=ModelConfig(hidden_size=32, layers=1, heads=2, intermediate_size=64),
    sft=SFTConfig(steps=3, batch_size=8),
)
PLAN = DemoPlan(
    methods=("grpo", "bapo"),
    staleness_e=(0, 1),
    async_delays=(1,),
    partial_rollout=True,
    seeds=(0,),
    rollout_steps=2,
    prompts_per_batch=2,
    group_size=2,
    segment_tokens=3,
    eval_every=1,
    eval_prompts=4,
    eval_k_during=2,
    final_k=2,
    lab="off",
    warmstart=TINY,
)


@pytest.mark.slow
def test_demo_produces_every_file_and_ends_with_its_headline(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import bapo.experiments.demo
    from bapo.cli.main import app

    monkeypatch.setattr(bapo.experiments.demo, "plan_for", lambda *args, **kwargs: PLAN)  # `bapo demo` on the tiny plan
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "demo"), "--jobs", "1", "--no-progress"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "demo"
    printed = result.output.strip().splitlines()
    assert printed[-1].startswith(f"report: {out / 'report.md'}")
    assert any(line.startswith("Tiny LLM: ") and "held" in line for line in printed)
    heldout_line = [line for line in printed if line.startswith("BAPO beats GRPO on held-out accuracy: ")]
    assert len(heldout_line) == 1 and any(f"E=1 {v} " in heldout_line[0] for v in ("held", "not held", "mixed"))
    assert (out / "data" / "train.jsonl").exists() and (out / "data" / "heldout.jsonl").exists()
    names = [
        "grpo-E0-seed0",  # at E=0 grpo stands for bapo too: one run
        "grpo-E1-seed0",
        "bapo-E1-seed0",
        "grpo-E0-asyncdelay1-seed0",
        "bapo-E0-asyncdelay1-seed0",
        "grpo-E0-partialrollout-seed0",
        "bapo-E0-partialrollout-seed0",
    ]
    assert sorted(p.name for p in out.iterdir() if (p / "metrics.jsonl").exists()) == sorted(names)
    for name in names:
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]
        updates_per_step = 2 if "E1" in name else 1
        assert len(rows) == 2 * updates_per_step, name
        assert "heldout/start/avg@2" in rows[updates_per_step - 1]
        assert {"heldout/avg@2", "heldout/pass@2"} <= set(rows[-1])
    for fig in FIGURES:
        assert (out / "plots" / f"{fig}.png").stat().st_size > 0, fig
    report = (out / "report.md").read_text()
    assert (
        report.index("## Summary")
        < report.index("## Claims")
        < report.index("## Plots")
        < report.index("## Per-run table")
        < report.index("## What the updates did")  # bapo's search outcomes at least
    )
    summary = report[report.index("## Summary") : report.index("## Setting")]
    assert "- Tiny LLM: " in summary and "- on-policy GRPO raises held-out avg@2" in summary
    run_table = report[report.index("## Per-run table") : report.index("## What the updates did")]
    assert "| start policy | sft |" in run_table and run_table.count("| E=1 |") == 2
    assert all(f"plots/{fig}.png" in report for fig in FIGURES)
    claims = read_json(out / "claims.json")
    assert {"0-rl-improves", "3-negative-dominate", "4-entropy-E=1"} <= {c["id"] for c in claims}
    assert all(set(c) >= {"id", "held", "effect", "interval", "seeds"} for c in claims)
    info = read_json(out / "demo.json")
    assert set(info["timings_s"]) >= {"warm start", "total", *names} and set(info["cpu_s"]) >= set(names)
    check_results_tables_regenerate(out, tmp_path, report)


def check_results_tables_regenerate(out, tmp_path, report):
    """scripts/demo_tables.py replaces exactly the marked block of a results file with this run's
    headline, claims and per-run tables, the same numbers as report.md."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    results = tmp_path / "RESULTS.md"
    start, end = "<!-- DEMO_TABLES:START (scripts/demo_tables.py) -->", "<!-- DEMO_TABLES:END -->"
    results.write_text(f"# Results\nbefore\n{start}\nold numbers\n{end}\nafter\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(root / "scripts" / "demo_tables.py"), str(out), "--write", str(results)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = results.read_text()
    assert text.startswith("# Results\nbefore\n" + start) and text.endswith(end + "\nafter\n")
    assert "old numbers" not in text and "- Tiny LLM: " in text
    per_run = report[report.index("| setting | method | seeds |") :].split("\n\n")[0]
    assert per_run in text  # the per-run table, cell for cell as in report.md


def test_a_run_is_deterministic_per_seed(tmp_path):
    plan = replace(PLAN, methods=("bapo",), staleness_e=(1,), async_delays=(), partial_rollout=False)
    first = run_demo(plan, tmp_path / "a", jobs=1, show_progress=False)
    second = run_demo(plan, tmp_path / "b", jobs=1, show_progress=False)

    def numbers(out):
        rows = [json.loads(line) for line in (out / "bapo-E1-seed0" / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))} for r in rows]

    assert numbers(first) == numbers(second)


def test_warm_start_is_cached_by_settings():
    first = warm_start(TINY)
    assert first.parent == cache_root() and (first / "config.json").exists()
    steps = []
    assert warm_start(TINY, on_step=lambda s, loss: steps.append(s)) == first and steps == []
    other = replace(TINY, sft=replace(TINY.sft, seed=1))
    assert warm_start(other) != first
    info = read_json(first / "warmstart.json")
    assert info["settings"]["sft"]["steps"] == 3 and info["heldout"]["n"] == 8  # scored on the whole held-out split


def test_profiles_make_valid_trainer_configs(tmp_path):
    """Every run of every profile (E -> mini_batches, async delay -> async_delay) is a valid config."""
    for plan in PROFILES.values():
        for spec in plan.runs():
            cfg = train_config(plan, spec, tmp_path, tmp_path / "train.jsonl", tmp_path / spec.name)
            assert cfg.loss.method == spec.method and cfg.offpolicy.async_delay == spec.async_delay
            assert cfg.updates_per_batch == spec.staleness_e + 1
            assert (cfg.rollout.segment_tokens is not None) == spec.partial_rollout
    specs = PROFILES["default"].runs()
    assert len(specs) == 5 * (1 + 4 * 2) and RunSpec("grpo", 0, seed=4) in specs  # 5 seeds
    assert RunSpec("bapo", 0, seed=0) not in specs  # identical to grpo on-policy


@pytest.mark.slow
def test_the_demo_pipeline_trains_every_peer_in_every_setting(tmp_path):
    """What `bapo demo --full` adds (PEERS), two rollout steps each on the tiny plan: every peer
    trains at E 0 and 1, with an async delay and with partial rollouts (decoupled-ppo keeping its
    proximal policy), and the report is written."""
    from bapo.experiments.demo import PEERS

    plan = replace(PLAN, methods=("grpo", *PEERS))
    out = run_demo(plan, tmp_path / "demo", jobs=1, show_progress=False)
    for peer in PEERS:
        for setting in ("E0", "E1", "E0-asyncdelay1", "E0-partialrollout"):
            rows = (out / f"{peer}-{setting}-seed0" / "metrics.jsonl").read_text().splitlines()
            assert len(rows) == 2 * (2 if setting == "E1" else 1), (peer, setting)
    assert (out / "report.md").exists()


def test_demo_progress_prints_a_plain_line_per_finished_run_when_stdout_is_not_a_terminal(capsys):
    """`make demo > log`: no rich bar (it would show only at the end), a line per stage and run."""
    from types import SimpleNamespace

    from bapo.experiments.progress import DemoProgress

    warmstart = SimpleNamespace(key=lambda: "never-cached-test-key", sft=SimpleNamespace(steps=8))
    plan = SimpleNamespace(warmstart=warmstart, rollout_steps=3)
    specs = [SimpleNamespace(name="grpo-E0-seed0"), SimpleNamespace(name="bapo-E2-seed0")]
    with DemoProgress(plan, specs) as progress:
        assert progress.plain and progress.bar is None  # capsys's stdout is not a terminal
        for step in range(8):
            progress.sft_step(step, 1.0)
        progress.sft_done()
        for name in ("grpo-E0-seed0", "bapo-E2-seed0"):
            progress.start_run(SimpleNamespace(name=name))
            for done in (1, 2, 3, 3):  # the last tick repeats: still one line
                progress.run_step(name, done)
        progress.finishing()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  (")[0] for line in lines] == [
        "bapo demo: warm start (SFT) 2/8  loss 1.000",
        "bapo demo: warm start (SFT) 4/8  loss 1.000",
        "bapo demo: warm start (SFT) 6/8  loss 1.000",
        "bapo demo: warm start done",
        "bapo demo: run grpo-E0-seed0 done, 1/2 runs",
        "bapo demo: run bapo-E2-seed0 done, 2/2 runs",
        "bapo demo: every run done; plots and report",
    ]
    assert all("elapsed, eta" in line for line in lines)
