"""The harness bapo demo and bapo study share (bapo.experiments.harness): plans, child processes,
run records and resume."""

from __future__ import annotations

import json
import os
from dataclasses import fields

import pytest

from bapo.experiments.demo import PROFILES as DEMO_PROFILES
from bapo.experiments.demo import plan_for as demo_plan_for
from bapo.experiments.harness import (
    RunPlan,
    RunSpec,
    is_done,
    mark_done,
    resume_point,
    run_in_child,
    run_pool,
    write_json,
)
from bapo.experiments.study import PROFILES as STUDY_PROFILES
from bapo.experiments.study import plan_for as study_plan_for


def square_with_progress(value: int, queue) -> tuple[int, int]:
    """A pool job: reports its pid, returns value squared (module level: spawned workers import it)."""
    queue.put((value, os.getpid()))
    return value, value * value


def exit_with(code: int) -> None:
    raise SystemExit(code)


def test_both_plans_have_what_the_harness_reads():
    wanted = set(RunPlan.__annotations__)
    for plan in (DEMO_PROFILES["quick"], STUDY_PROFILES["quick"]):
        assert wanted <= {field.name for field in fields(plan)}, type(plan).__name__
        assert plan.max_new_tokens > 0 and all(isinstance(spec, RunSpec) for spec in plan.runs())


def test_plan_for_replaces_given_fields_and_ignores_none():
    assert study_plan_for("quick", lr=3e-5, seeds=None).lr == 3e-5
    assert study_plan_for("quick", seeds=None).seeds == STUDY_PROFILES["quick"].seeds
    demo = demo_plan_for("quick", sft_steps=7, rollout_steps=None)
    assert demo.warmstart.sft.steps == 7 and demo.rollout_steps == DEMO_PROFILES["quick"].rollout_steps


def test_run_pool_yields_every_result_and_forwards_progress():
    messages = []
    results = list(run_pool(square_with_progress, [(2,), (3,), (4,)], 2, messages.append))
    assert sorted(results) == [(2, 4), (3, 9), (4, 16)]
    # messages are drained while jobs are pending (the last ones may land after the pool is done),
    # so at least the first job's message came through, each from a worker process
    assert messages and {value for value, _ in messages} <= {2, 3, 4}
    assert all(pid != os.getpid() for _, pid in messages)


def test_run_in_child_reports_the_exit_code():
    assert run_in_child(exit_with, 0) == 0
    assert run_in_child(exit_with, 3) == 3


def test_a_run_is_done_only_after_mark_done_which_drops_its_checkpoints(tmp_path):
    run_dir = tmp_path / "grpo-E4-seed0"
    assert resume_point(run_dir) is None and not is_done(run_dir)  # never started
    (run_dir / "checkpoints" / "update_000001").mkdir(parents=True)
    mark_done(run_dir, {"wall_s": 1.0})
    assert is_done(run_dir) and not (run_dir / "checkpoints").exists()
    assert json.loads((run_dir / "done.json").read_text()) == {"wall_s": 1.0}
    assert resume_point(run_dir) is None  # nothing left to resume from


def test_write_json_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "deep" / "study.json"
    write_json(path, {"runs": {}})
    assert json.loads(path.read_text()) == {"runs": {}} and os.listdir(path.parent) == ["study.json"]


@pytest.mark.parametrize("spec", [RunSpec("bapo", 4, seed=2), RunSpec("grpo", 0, 16, seed=1)])
def test_the_run_record_names_method_setting_and_seed(spec):
    record = spec.record()
    assert (record["method"], record["setting"], record["seed"]) == (spec.method, spec.setting, spec.seed)
    assert RunSpec(**{name: record[name] for name in ("method", "staleness_e", "async_delay", "seed")}) == spec
