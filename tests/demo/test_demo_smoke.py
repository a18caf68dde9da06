"""Two updates of the whole demo pipeline on a tiny warm start: every output file appears."""

import json
from dataclasses import replace

import pytest

from bapo.demo.demo import DemoPlan, run_demo
from bapo.train.tiny import ModelConfig
from bapo.analysis.plots import FIGURES
from bapo.demo.task import TaskConfig
from bapo.demo.warmstart import SFTConfig, WarmStartConfig, cache_root, warm_start



def read_json(path):
    return json.loads(path.read_text())

TINY = WarmStartConfig(task=TaskConfig(n_train=64, n_heldout=8),
                       model=ModelConfig(hidden_size=32, layers=1, heads=2, intermediate_size=64),
                       sft=SFTConfig(steps=3, batch_size=8))
PLAN = DemoPlan(methods=("grpo", "bapo"), staleness=(0, 1), partial_rollout=True, steps=2,
                prompts_per_batch=2, group_size=2, max_new_tokens=8, segment_tokens=3,
                eval_every=1, eval_prompts=4, eval_k_during=2, final_k=2, warmstart=TINY)


@pytest.mark.slow
def test_demo_produces_every_file(tmp_path):
    out = run_demo(PLAN, tmp_path / "demo", show_progress=False)
    assert (out / "data" / "train.jsonl").exists() and (out / "data" / "heldout.jsonl").exists()
    names = ["grpo-staleness0-seed0", "bapo-staleness0-seed0", "grpo-staleness1-seed0",
             "bapo-staleness1-seed0", "grpo-partialrollout-seed0", "bapo-partialrollout-seed0"]
    for name in names:
        rows = [l for l in (out / name / "metrics.jsonl").read_text().splitlines() if l]
        assert len(rows) == 2, name
        assert '"heldout/accuracy"' in rows[0] and '"heldout/accuracy"' in rows[1]
        final = read_json(out / name / "final_eval.json")
        assert final["k"] == 2 and final["n"] == 8  # every held-out prompt, k samples each
        assert 0 <= final["avg@2"] <= final["pass@2"] <= 1
        assert read_json(out / name / "demo_run.json")["method"] in ("grpo", "bapo")
    for fig in FIGURES:
        assert (out / "plots" / f"{fig}.png").stat().st_size > 0, fig
    report = (out / "report.md").read_text()
    assert report.count("| staleness ") == 4 and report.count("| partial rollout |") == 2
    assert "| start policy | sft |" in report
    assert all(f"plots/{fig}.png" in report for fig in FIGURES)
    assert "## What the numbers show" in report
    assert set(read_json(out / "demo.json")["timings_s"]) >= {"warm start", "total", *names}


def test_warm_start_is_cached_by_settings():
    first = warm_start(TINY)
    assert first.parent == cache_root() and (first / "config.json").exists()
    steps = []
    assert warm_start(TINY, on_step=lambda s, loss: steps.append(s)) == first and steps == []
    other = replace(TINY, sft=replace(TINY.sft, slip_rate=0.5))
    assert warm_start(other) != first
    info = read_json(first / "warmstart.json")
    assert info["settings"]["sft"]["steps"] == 3 and info["heldout"]["n"] == 8  # scored on the whole held-out split


def test_full_profile_configs_are_valid(tmp_path):
    """--full's runs (topr, dcpo, partial rollout, 3 seeds) all make valid trainer configs."""
    from bapo.demo.demo import PROFILES, train_config

    plan = PROFILES["full"]
    specs = plan.runs()
    assert len(specs) == 5 * 3 * 3 and len({s.name for s in specs}) == len(specs)
    for spec in specs:
        cfg = train_config(plan, spec, tmp_path, tmp_path / "train.jsonl", tmp_path / spec.name)
        assert cfg.loss.method == spec.method and cfg.offpolicy.staleness == spec.staleness
        assert (cfg.rollout.segment_tokens is not None) == spec.partial_rollout
