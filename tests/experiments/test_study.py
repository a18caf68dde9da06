"""`bapo study` without vLLM: the plan, the on-policy sharing it relies on, a whole tiny study
(report, claims, token-kind entropy, start scores), and --resume (finished runs are not rerun, a
started run resumes from its checkpoint)."""

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bapo.experiments.arith import ArithTaskConfig, make_split, problems, verify
from bapo.experiments.study import (
    FULL_PLAN_METHODS,
    HEADLINE_METHODS,
    METHODS,
    OWN_ON_POLICY_RUN_METHODS,
    PEERS,
    PROFILES,
    StudyPlan,
    load_plan,
    run_study,
)
from bapo.train.tiny import ModelConfig, save_tiny_model

TASK = ArithTaskConfig(a_min=2, a_max=9, b_min=2, b_max=9, n_heldout=6, n_train=40, system_prompt="", max_new_tokens=4)


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """The built-in character-level Llama (digits are tokens of their own), random init."""
    return save_tiny_model(
        tmp_path_factory.mktemp("char_model"), ModelConfig(hidden_size=16, layers=1, heads=2, intermediate_size=32)
    )


def tiny_plan(model, **changes) -> StudyPlan:
    plan = StudyPlan(
        methods=("grpo", "bapo"),
        staleness_e=(0, 1),
        async_delays=(1,),
        seeds=(0,),
        rollout_steps=2,
        prompts_per_batch=2,
        group_size=2,
        lr=1e-3,
        eval_every=1,
        eval_prompts=4,
        eval_k_during=2,
        final_k=2,
        model=str(model),
        backend="hf",
        checkpoint_every=1,
        chat=False,
        task=TASK,
    )
    return replace(plan, **changes)


def test_full_plan_shares_the_on_policy_run_and_has_every_cell():
    plan = PROFILES["full"]
    runs = plan.runs()
    # claim 5 judges every method that claim 4 does not (BAPO's two presets) against GRPO
    assert set(PEERS) | set(HEADLINE_METHODS) == set(METHODS) and not set(PEERS) & set(HEADLINE_METHODS)
    assert plan.methods == FULL_PLAN_METHODS and not set(FULL_PLAN_METHODS) & set(OWN_ON_POLICY_RUN_METHODS)
    per_seed = 1 + len(plan.methods) * 3  # grpo at E=0, every method at E=4, k=4, k=16
    assert len(runs) == per_seed * len(plan.seeds) == 57
    assert {spec.method for spec in runs if spec.setting == "E=0"} == {"grpo"}
    for setting in ("E=4", "E=0, async delay 4", "E=0, async delay 16"):
        assert {spec.method for spec in runs if spec.setting == setting} == set(plan.methods)
    assert len({spec.name for spec in runs}) == len(runs)
    quick = PROFILES["quick"].runs()
    assert [(spec.method, spec.setting) for spec in quick] == [("grpo", "E=4"), ("bapo", "E=4")]


def test_a_plan_whose_batch_e_plus_1_does_not_divide_fails_at_once():
    with pytest.raises(ValueError, match="staleness E=4: E\\+1 optimizer updates must divide the rollout batch of 32"):
        replace(PROFILES["full"], prompts_per_batch=4)
    for plan in PROFILES.values():
        assert all(plan.prompts_per_batch * plan.group_size % (e + 1) == 0 for e in plan.staleness_e)


def test_autocast_auto_is_resolved_when_the_plan_is_made_and_kept_on_resume(monkeypatch):
    """A study made on a bf16 machine keeps bf16 when resumed on an AVX2-only one, and vice versa:
    study.json holds the resolved value, never "auto"."""
    import bapo.experiments.study as study

    for native, expected in ((True, "bfloat16"), (False, "none")):
        monkeypatch.setattr(study, "native_bf16", lambda device, native=native: native)
        plan = StudyPlan()
        assert plan.autocast == expected
        saved = json.loads(json.dumps(plan.to_json()))
        monkeypatch.setattr(study, "native_bf16", lambda device, native=native: not native)
        assert StudyPlan.from_json(saved).autocast == expected
    with pytest.raises(ValueError, match="autocast='fp16'"):
        StudyPlan(autocast="fp16")


@pytest.mark.parametrize("native", [True, False])
def test_done_json_says_which_kernels_ran_a_bf16_run(char_model, tmp_path, monkeypatch, native):
    """A bf16 plan resumed on a CPU without bf16 units runs its GEMMs in fp32 (bapo.train.precision):
    each run's done.json records which, so a report can tell the runs apart."""
    import bapo.experiments.study as study
    import bapo.train.precision as precision

    monkeypatch.setattr(study, "native_bf16", lambda device, native=native: native)
    monkeypatch.setattr(precision, "native_bf16", lambda device_type, native=native: native)
    plan = tiny_plan(char_model, methods=("grpo",), staleness_e=(0,), async_delays=(), autocast="bfloat16")
    run_study(plan, tmp_path / "study", threads=1, in_process=True, log=lambda line: None)
    (name,) = [spec.name for spec in plan.runs()]
    done = json.loads((tmp_path / "study" / name / "done.json").read_text())
    assert done["bf16_gemms"] == ("torch" if native else "fp32 on bf16-rounded operands")


def test_task_split_is_disjoint_and_the_verifier_reads_the_last_integer():
    train, heldout = make_split(replace(TASK, n_heldout=20))
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in heldout}
    assert len(problems(TASK)) == 64 and len(heldout) == 20
    row = {"prompt": "What is 7 + 15?", "answer": "22"}
    assert verify("The answer is 22.", row) == 1.0
    assert verify("7 + 15 = 22, so the answer is 23", row) == 0.0
    assert verify("no number", row) == 0.0
    with pytest.raises(ValueError, match="n_heldout"):
        make_split(replace(TASK, n_heldout=64))


def test_every_study_method_gives_grpos_update_on_policy(char_model, tmp_path):
    """The reason E=0 is one run per seed: with every ratio 1 (a batch the current weights just
    generated), each loss moves the weights exactly as grpo does; grpo-seq-mean (another
    aggregation) does not, which is why it runs its own E=0 runs (icepop and opsm act on the vLLM
    engine's gap, which this HF-sampled batch does not have)."""
    from bapo.experiments.study import train_config
    from bapo.train import Trainer
    from bapo.train.update import optimizer_update

    plan = tiny_plan(char_model, prompts_per_batch=4, group_size=4)
    spec_cfg = {}
    from bapo.experiments.harness import RunSpec
    from bapo.experiments.study import prepare

    prepare(plan, tmp_path / "study")
    for method in [m for m in METHODS if m not in ("icepop", "opsm")]:  # vLLM-only (icepop) or its gap (opsm)
        spec_cfg[method] = train_config(plan, RunSpec(method), char_model, tmp_path / "study", tmp_path / method)
    trainer = Trainer(spec_cfg["grpo"], verifier=lambda response, row: float(len(response) % 2))
    batch, _ = trainer.rollout_step()
    trainer.close()
    assert batch.advantages.abs().sum() > 0
    deltas = {}
    for method, cfg in spec_cfg.items():
        model = copy.deepcopy(trainer.model)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        optimizer_update(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), batch, cfg, version=0)
        deltas[method] = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert deltas["grpo"].abs().max() > 0
    assert not torch.allclose(deltas.pop("grpo-seq-mean"), deltas["grpo"], rtol=1e-3, atol=1e-6)
    for method, delta in deltas.items():
        torch.testing.assert_close(delta, deltas["grpo"], rtol=1e-5, atol=1e-7, msg=method)


def test_decoupled_ppo_trains_as_grpo_at_staleness_e_without_delay(char_model, tmp_path):
    """Why the study's report lists decoupled-ppo and grpo at E=4 as identical: without an async
    delay the proximal policy (the weights before a batch's first update) is the behaviour policy,
    so its weight pi_prox/mu is 1 and its ratio is grpo's, over every mini-batch update.

    Bit equality is guaranteed here whatever the CPU's kernels: the trainer reuses the behaviour
    log-probs as the proximal ones for tokens the current weights sampled (with_proximal_log_prob),
    so the weight is exp(0) = 1 exactly and x * 1 = x; both runs then do the same operations on the
    same numbers. (A second forward would differ from the sampler's log-probs in the last bits on
    some instruction sets: AVX2 did, AVX-512 did not.)"""
    from bapo.experiments.harness import RunSpec
    from bapo.experiments.study import prepare, train_config
    from bapo.train import Trainer

    plan = tiny_plan(char_model, prompts_per_batch=4, group_size=4)
    prepare(plan, tmp_path / "study")
    weights, losses = {}, {}
    for method in ("grpo", "decoupled-ppo"):
        cfg = train_config(plan, RunSpec(method, 1), char_model, tmp_path / "study", tmp_path / method)
        trainer = Trainer(cfg, verifier=lambda response, row: float(len(response) % 2))
        rows = []
        for _ in range(2):
            batch, _ = trainer.rollout_step()
            rows += trainer.update_step(batch)
        trainer.close()
        assert len(rows) == 4  # E+1 = 2 updates per rollout step
        losses[method] = [row["loss"] for row in rows]
        weights[method] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert any(loss != 0 for loss in losses["grpo"])
    assert losses["decoupled-ppo"] == losses["grpo"]
    assert torch.equal(weights["decoupled-ppo"], weights["grpo"])


def test_lora_study_trains_adapters_only_and_keeps_its_rank_in_the_plan(char_model, tmp_path):
    """`bapo study --lora-rank N`: every run's config trains peft adapters (alpha 32, every linear
    layer), the plan saved in study.json keeps the rank, and a study.json from before the option
    loads as full fine-tuning."""
    pytest.importorskip("peft")
    from bapo.experiments.harness import RunSpec
    from bapo.experiments.study import prepare, train_config
    from bapo.train import Trainer

    plan = tiny_plan(char_model, lora_rank=2)
    assert StudyPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    old_record = {name: value for name, value in plan.to_json().items() if name != "lora_rank"}
    assert StudyPlan.from_json(old_record).lora_rank is None
    prepare(plan, tmp_path / "study")
    cfg = train_config(plan, RunSpec("grpo"), char_model, tmp_path / "study", tmp_path / "grpo")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (2, 32.0, "all-linear")
    trainer = Trainer(cfg, verifier=lambda response, row: float(len(response) % 2))
    trained = [name for name, param in trainer.model.named_parameters() if param.requires_grad]
    trainer.close()
    assert trained and all("lora_" in name for name in trained)
    full = train_config(replace(plan, lora_rank=None), RunSpec("grpo"), char_model, tmp_path / "study", tmp_path / "f")
    assert full.model.lora.rank is None


def test_step_time_line_counts_each_rollout_step_once_and_sums_its_updates():
    """The report's cost line (issue 36's push <= 5% of a rollout step): metrics.jsonl has one row
    per optimizer update, so at staleness E a step's timers repeat on E+1 rows and its update time
    is their sum; medians are over rollout steps, the push share taken step by step (not the ratio
    of the medians)."""
    from bapo.analysis.runs import Run
    from bapo.experiments.study import step_time_lines

    def rows(rollout_step, step_s, push_s, updates):  # one row per optimizer update of the step
        timers = {"time/rollout_step_s": step_s, "time/rollout_s": step_s / 2, "time/vllm_sample_s": step_s / 4}
        timers["time/vllm_push_s"] = push_s
        return [{"rollout_step": rollout_step, **timers, "time/update_s": update_s} for update_s in updates]

    stale = Run(Path("a"), "grpo", "E=2", 0, rows(0, 10.0, 0.1, [2.0, 1.0, 2.0]) + rows(1, 20.0, 1.0, [3.0, 3.0, 4.0]))
    on_policy = Run(Path("b"), "grpo", "E=0", 0, rows(0, 30.0, 0.3, [15.0]))
    assert [step["update_s"] for step in stale.rollout_step_times()] == [5.0, 10.0]
    (line,) = step_time_lines([stale, on_policy])
    assert line.startswith("Time per rollout step (medians over every rollout step of the finished runs): 20.0 s:")
    assert "rollout 10.0 s (vLLM sampling 5.0 s; weight push 0.30 s = 1.0% of a rollout step, at most 5.0%)" in line
    assert line.endswith("optimizer updates 10.0 s.")
    assert step_time_lines([Run(Path("c"), "grpo", "E=0", 0, [{"rollout_step": 0, "loss": 1.0}])]) == []


def test_tiny_study_writes_report_and_resume_skips_finished_runs(char_model, tmp_path, monkeypatch):
    study_dir = tmp_path / "study"
    plan = tiny_plan(char_model)
    # --max-runs: a sitting that stops after 2 finished runs, in the plan's order; the next one goes on
    lines: list[str] = []
    run_study(plan, study_dir, threads=1, in_process=True, log=lines.append, max_runs=2)
    names = [spec.name for spec in plan.runs()]
    assert [name for name in names if (study_dir / name / "done.json").exists()] == names[:2]
    assert not any((study_dir / name).exists() for name in names[2:])
    assert any("this sitting trains 2 of them (--max-runs)" in line for line in lines)
    run_study(plan, study_dir, threads=1, in_process=True, log=lambda line: None)
    assert len(names) == 5  # grpo E=0, grpo and bapo at E=1 and at delay 1
    for name in names:
        assert (study_dir / name / "done.json").exists()
        assert not (study_dir / name / "checkpoints").exists()  # removed once finished
    rows = [json.loads(line) for line in (study_dir / names[1] / "metrics.jsonl").read_text().splitlines()]
    assert all({"entropy/digit", "entropy/other", "tokens/digit_share", "grad_norm"} <= set(row) for row in rows)
    assert {"heldout/start/avg@2", "heldout/accuracy", "heldout/pass"} <= set(rows[1])  # E=1: 2 rows per step
    assert {"heldout/avg@2", "heldout/pass@2"} <= set(rows[-1])
    assert json.loads((study_dir / "start.json").read_text())["n"] == TASK.n_heldout
    report = (study_dir / "report.md").read_text()
    assert report.startswith("# bapo study report") and "## Per-run table" in report
    assert "Runs finished: 5 of 5;" in report and "entropy digits" in report
    assert "Time per rollout step (medians over every rollout step of the finished runs):" in report  # hf: no push
    claim_ids = {claim["id"] for claim in json.loads((study_dir / "claims.json").read_text())}
    assert {"0-rl-improves", "4-heldout-E=1", "4-entropy-digit-E=1", "4-entropy-other-E=1"} <= claim_ids
    assert (study_dir / "plots" / "entropy_by_kind.png").exists()
    assert load_plan(study_dir) == plan

    # the docs block, through the CLI: --resume DIR --report --results FILE
    from typer.testing import CliRunner

    from bapo.cli.main import app
    from bapo.experiments.study import TABLES_END, TABLES_START

    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Results\n{TABLES_START}\nOLD-BLOCK\n{TABLES_END}\nafter\n")
    done = CliRunner().invoke(app, ["study", "--resume", str(study_dir), "--report", "--results", str(results)])
    assert done.exit_code == 0, done.output
    text = results.read_text()
    assert "OLD-BLOCK" not in text and text.endswith("after\n") and "| setting | method | seeds |" in text
    assert "SmolLM2-135M-Instruct: " in text and "4-entropy-digit-E=1" in text
    refused = CliRunner().invoke(app, ["study", "--resume", str(study_dir), "--seeds", "0"])
    assert refused.exit_code != 0 and "--resume continues the saved plan" in refused.output

    # --resume: a finished run is not rerun; a run with a checkpoint and no done.json resumes from it
    import shutil

    import bapo.experiments.harness as harness
    import bapo.experiments.study as study
    import bapo.train

    unfinished, spec = study_dir / names[-1], plan.runs()[-1]
    shutil.rmtree(unfinished)  # interrupted after its first rollout step: a checkpoint, no done.json
    monkeypatch.setattr(harness, "drop_checkpoints", lambda run_dir: None)
    study.run_one(replace(plan, rollout_steps=1), spec, study_dir, threads=1)
    (unfinished / "done.json").unlink()
    assert (unfinished / "checkpoints").is_dir()
    metrics_before = (study_dir / names[0] / "metrics.jsonl").read_text()
    calls, real_train = [], bapo.train.train

    def spy(cfg, *args, resume=None, **kwargs):
        calls.append((cfg.run.output_dir, resume))
        return real_train(cfg, *args, resume=resume, **kwargs)

    monkeypatch.setattr(bapo.train, "train", spy)
    from bapo.train.config import ConfigError
    from bapo.train.rundir import RunLock

    held = RunLock(study_dir)  # another study process on this folder: refused, nothing trained
    with pytest.raises(ConfigError, match="in use by another bapo process"):
        run_study(load_plan(study_dir), study_dir, threads=1, in_process=True, log=lambda line: None)
    held.release()
    assert calls == []
    run_study(load_plan(study_dir), study_dir, threads=1, in_process=True, log=lambda line: None)
    assert calls == [(str(unfinished), unfinished)]
    assert (study_dir / names[0] / "metrics.jsonl").read_text() == metrics_before
    steps = [json.loads(line)["rollout_step"] for line in (unfinished / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # the resumed run trained its second rollout step only (delay 1: one row each)
    assert (unfinished / "done.json").exists()

    # the regime gate of the finished grpo runs, through the CLI (one seed: no interval for (a))
    gate = CliRunner().invoke(app, ["study", "--gate", str(study_dir)])
    assert gate.exit_code == 0, gate.output
    assert "| E=0 | 0 |" in gate.output and "| E=1 | 0 |" in gate.output and "| E=0, async delay 1 | 0 |" in gate.output
    assert "(a) on-policy held-out lift: 1 finished seed(s)" in gate.output
    assert "- (b) E=1: unrewarded / rewarded length by third" in gate.output and "- (c) E=1: " in gate.output
    monkeypatch.chdir(tmp_path)  # a short path: typer's error box wraps long lines
    missing = CliRunner().invoke(app, ["study", "--gate", "."])
    assert missing.exit_code == 2 and "holds no study (no study.json)" in missing.output
    mixed = CliRunner().invoke(app, ["study", "--gate", ".", "--lr", "1e-5"])
    assert mixed.exit_code == 2 and "--gate only reads study folders" in mixed.output


def test_regime_plan_is_grpo_alone_at_a_64_token_budget_with_whole_stale_mini_batches():
    """The regime gate's plan: grpo only (the gate is chosen before any other method runs), a
    64-token budget, E+1 = 4 mini-batches of 2 whole groups, an async delay, 40 rollout steps."""
    regime = PROFILES["regime"]
    assert set(regime.methods) == {"grpo"} and regime.max_new_tokens == 64
    assert {spec.setting for spec in regime.runs()} == {"E=0", "E=3", "E=0, async delay 8"}
    assert (regime.prompts_per_batch * regime.group_size) % 4 == 0 and regime.rollout_steps == 40
    assert StudyPlan.from_json(json.loads(json.dumps(regime.to_json()))) == regime


def test_plan_with_partial_rollout_and_the_new_methods_runs_each_cell_once_and_configures_it(char_model, tmp_path):
    """The regime plan's cells: grpo-seq-mean, icepop and opsm run their own E=0 runs (their
    on-policy gradient is not GRPO's), partial rollout ends the headline methods' runs, with the
    plan's segment, and each new method's config is the one its comment names."""
    from bapo.experiments.harness import RunSpec
    from bapo.experiments.study import train_config

    plan = replace(
        PROFILES["regime"],
        methods=("grpo", "bapo", "grpo-seq-mean", "dppo-tv", "icepop", "opsm"),
        partial_rollout_methods=("grpo", "bapo"),
        seeds=(0, 1),
    )
    runs = plan.runs()
    assert len({spec.name for spec in runs}) == len(runs) == 2 * (4 + 6 + 6 + 2)
    assert {spec.method for spec in runs if spec.setting == "E=0"} == {"grpo", "grpo-seq-mean", "icepop", "opsm"}
    partial = [spec for spec in runs if spec.partial_rollout]
    headline = [spec for spec in runs if spec.method in ("grpo", "bapo")]
    assert runs[: len(headline)] == headline and headline[-len(partial) :] == partial  # after E and delay
    assert {spec.setting for spec in partial} == {"E=0, partial rollout"}
    assert [spec.name for spec in partial] == [
        f"{m}-E0-partialrollout-seed{s}" for s in (0, 1) for m in ("grpo", "bapo")
    ]
    assert StudyPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    old_record = {
        k: v for k, v in PROFILES["full"].to_json().items() if k not in ("partial_rollout_methods", "segment_tokens")
    }
    assert (
        StudyPlan.from_json(old_record).partial_rollout_methods,
        StudyPlan.from_json(old_record).segment_tokens,
    ) == (
        (),
        2,  # a quarter of the full plan's 10-token budget
    )
    assert plan.segment_tokens == 16  # a quarter of the regime's 64
    # the shared E=0 run is grpo's even when grpo is not among the methods or not first
    alone = replace(plan, methods=("grpo-seq-mean", "bapo"), partial_rollout_methods=(), seeds=(0,))
    assert [spec.name for spec in alone.runs() if spec.setting == "E=0"] == ["grpo-E0-seed0", "grpo-seq-mean-E0-seed0"]

    vllm = replace(tiny_plan(char_model), backend="vllm", segment_tokens=2)
    configs = {
        spec.name: train_config(vllm, spec, char_model, tmp_path / "study", tmp_path / spec.name)
        for spec in (RunSpec("grpo-seq-mean"), RunSpec("dppo-tv"), RunSpec("icepop"), RunSpec("opsm"))
        + (RunSpec("bapo", partial_rollout=True), RunSpec("bapo"))
    }
    loss = {name: cfg.loss for name, cfg in configs.items()}
    assert (loss["grpo-seq-mean-E0-seed0"].method, loss["grpo-seq-mean-E0-seed0"].agg_mode) == (
        "grpo",
        "seq-mean-token-mean",
    )
    assert (loss["dppo-tv-E0-seed0"].method, loss["dppo-tv-E0-seed0"].resolved_agg_mode) == ("dppo-tv", "token-mean")
    assert configs["icepop-E0-seed0"].rollout.correction == "icepop" and loss["icepop-E0-seed0"].method == "grpo"
    assert loss["opsm-E0-seed0"].off_policy_mask == 0.5 and loss["opsm-E0-seed0"].method == "grpo"
    assert configs["bapo-E0-partialrollout-seed0"].rollout.segment_tokens == 2
    assert configs["bapo-E0-seed0"].rollout.segment_tokens is None


def test_plan_refuses_a_bad_partial_rollout_or_an_engine_correction_without_vllm():
    regime = PROFILES["regime"]
    with pytest.raises(ValueError, match="partial_rollout_methods: gpro not among"):
        replace(regime, partial_rollout_methods=("gpro",))
    with pytest.raises(ValueError, match="segment_tokens=64: partial rollout needs a segment between 1 and"):
        replace(regime, partial_rollout_methods=("grpo",), segment_tokens=64)
    assert replace(regime, segment_tokens=64).partial_rollout_methods == ()  # no partial rollout: unused
    with pytest.raises(ValueError, match="partial_rollout_methods: add grpo, the baseline"):
        replace(regime, partial_rollout_methods=("bapo",))
    with pytest.raises(ValueError, match="partial_rollout_methods: grpo given twice; name each method once"):
        replace(regime, partial_rollout_methods=("grpo", "bapo", "grpo"))
    with pytest.raises(ValueError, match="methods: bapo given twice"):
        replace(regime, methods=("grpo", "bapo", "bapo"))
    with pytest.raises(ValueError, match="methods: icepop weighs tokens by the vLLM engine's gap, which backend hf"):
        replace(PROFILES["gpu"], methods=("grpo", "icepop"))


def test_reuse_copies_only_the_finished_runs_the_plan_would_train_alike(char_model, tmp_path):
    """--reuse: the gate's grpo run enters the plan that follows it; a source of another lr or
    held-out setting is named with the field and left alone, and a run already finished stays."""
    import shutil

    from bapo.experiments.study import header, prepare, reuse_runs

    gate = tmp_path / "gate"
    run_study(
        tiny_plan(char_model, methods=("grpo",), staleness_e=(0,), async_delays=()), gate, threads=1, in_process=True
    )

    def variant(name: str, **plan_changes) -> Path:
        folder = tmp_path / name
        shutil.copytree(gate, folder)
        info = json.loads((folder / "study.json").read_text())
        info["plan"].update(plan_changes)
        (folder / "study.json").write_text(json.dumps(info))
        return folder

    other_lr, other_eval, old_code = variant("lr", lr=2e-3), variant("eval", eval_every=2), variant("old")
    # a run trained by code whose defaults differed: its saved config.yaml says so
    saved = old_code / "grpo-E0-seed0" / "config.yaml"
    saved.write_text(saved.read_text().replace("group_size: 2", "group_size: 3"))
    plan, study_dir = tiny_plan(char_model), tmp_path / "plan"
    prepare(plan, study_dir)
    lines: list[str] = []
    assert reuse_runs(plan, study_dir, [other_lr, other_eval, old_code], lines.append) == []
    assert lines == [
        f"not reused: {other_lr / 'grpo-E0-seed0'} differs in optim.lr 0.002 (this plan: 0.001)",
        f"not reused: the 1 finished runs of {other_eval} this plan has: they differ in eval_every 2 (this plan: 1)",
        f"not reused: {old_code / 'grpo-E0-seed0'} differs in rollout.group_size 3 (this plan: 2)",
    ]
    assert not (study_dir / "grpo-E0-seed0").exists()
    (study_dir / "grpo-E0-seed0").mkdir()  # a started, unfinished run: the finished one replaces it
    assert reuse_runs(plan, study_dir, [gate], lines.append) == ["grpo-E0-seed0"]
    assert sorted(path.name for path in study_dir.iterdir() if path.name.endswith(".reusing")) == []
    copied = (study_dir / "grpo-E0-seed0" / "metrics.jsonl").read_text()
    assert copied == (gate / "grpo-E0-seed0" / "metrics.jsonl").read_text()
    record = json.loads((study_dir / "study.json").read_text())["runs"]["grpo-E0-seed0"]
    assert record["reused_from"] == str(gate / "grpo-E0-seed0") and record["wall_s"] > 0
    assert reuse_runs(plan, study_dir, [gate], lines.append) == []  # finished here: kept
    line = " ".join(header(plan, study_dir))
    assert f"Runs finished: 1 of 5 (PARTIAL study), 1 of them reused from {gate};" in line
    assert "s summed (the reused runs' in their own study)." in line


def test_full_plan_trains_the_headline_cells_of_every_seed_first():
    """A partial study is a useful one: grpo at E=0 and grpo / bapo / bapo-paper at E=4 for all
    three seeds come first, then the same three at delay 4 and at delay 16, then the other methods
    on each axis in turn."""
    runs = PROFILES["full"].runs()
    first = [(spec.method, spec.setting, spec.seed) for spec in runs[:12]]
    assert {cell[:2] for cell in first} == {("grpo", "E=0"), ("grpo", "E=4"), ("bapo", "E=4"), ("bapo-paper", "E=4")}
    assert sorted(cell[2] for cell in first) == [0] * 4 + [1] * 4 + [2] * 4
    assert first[:4] == [("grpo", "E=0", 0), ("grpo", "E=4", 0), ("bapo", "E=4", 0), ("bapo-paper", "E=4", 0)]
    headline = {spec.method for spec in runs[:30]}
    assert headline == set(HEADLINE_METHODS) and not headline & {spec.method for spec in runs[30:]}
    assert {spec.setting for spec in runs[12:21]} == {"E=0, async delay 4"}
    assert {spec.setting for spec in runs[21:30]} == {"E=0, async delay 16"}
    assert [{spec.setting for spec in runs[start : start + 9]} for start in (30, 39, 48)] == [
        {"E=4"},
        {"E=0, async delay 4"},
        {"E=0, async delay 16"},
    ]
    # the regime plan's control (grpo-seq-mean) comes after the headline methods, before the other peers
    plan = replace(
        PROFILES["regime"], methods=("grpo", "m2po", "grpo-seq-mean", "bapo"), partial_rollout_methods=("grpo", "bapo")
    )
    tiers = [spec.method for spec in plan.runs()]
    assert tiers.index("grpo-seq-mean") > max(i for i, m in enumerate(tiers) if m in ("grpo", "bapo"))
    assert tiers.index("m2po") > max(i for i, m in enumerate(tiers) if m == "grpo-seq-mean")


def test_gpu_plan_is_the_regime_plan_on_cuda_without_the_vllm_only_method(tmp_path):
    """scripts/gpu_study.sh runs the current regime: the plan saved in docs/study/regime-plan, field
    for field, but on CUDA with HF rollout (no vLLM there, so no icepop) and sparser checkpoints."""
    gpu = PROFILES["gpu"]
    saved = json.loads((Path(__file__).parents[2] / "docs/study/regime-plan/study.json").read_text())["plan"]
    cpu = StudyPlan.from_json(saved)
    moved = {"backend", "device", "vllm_enforce_eager", "checkpoint_every", "model", "methods"}
    assert {k: v for k, v in gpu.to_json().items() if k not in moved} == {
        k: v for k, v in cpu.to_json().items() if k not in moved
    }
    assert gpu.methods == tuple(method for method in cpu.methods if method != "icepop") and "icepop" in cpu.methods
    assert (gpu.device, gpu.backend, gpu.autocast, gpu.lr) == ("cuda", "hf", "bfloat16", 1e-6)
    assert {s.setting for s in gpu.runs()} == {s.setting for s in cpu.runs()}
    assert {s.method for s in gpu.runs()} == set(cpu.methods) - {"icepop"}
    from bapo.experiments.study import train_config

    for spec in {(s.method, s.setting): s for s in gpu.runs()}.values():  # each run's config validates
        train_config(replace(gpu, device="cpu"), spec, tmp_path / "model", tmp_path, tmp_path / "run")
    assert StudyPlan.from_json(json.loads(json.dumps(gpu.to_json()))) == gpu
    old = {k: v for k, v in gpu.to_json().items() if k != "device"}  # a study.json from before the field
    assert StudyPlan.from_json(json.loads(json.dumps(old))).device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_study_gpu_without_cuda_fails_in_one_line_before_any_work(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import bapo.experiments.smollm2 as smollm2
    from bapo.cli.main import app

    monkeypatch.setattr(smollm2, "convert", lambda *a, **k: pytest.fail("converted the model before the check"))
    result = CliRunner().invoke(app, ["study", "--gpu", "--out", str(tmp_path / "gpu")])
    assert result.exit_code == 2
    assert "the plan's device is cuda: this machine has no CUDA" in result.output
    assert not (tmp_path / "gpu").exists()


def _task_probe():
    """scripts/task_probe.py as a module (scripts/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "task_probe.py"
    spec = importlib.util.spec_from_file_location("task_probe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["task_probe"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_task_probe_draws_valid_questions_and_probes_the_study_task_as_configured():
    """The probe behind the study's task choice: its draws are distinct, inside the operand ranges,
    answered right (a - b >= 0 for subtraction), and its "study task" row is the task the study
    trains on (bapo.experiments.arith's defaults), prompt for prompt."""
    probe = _task_probe()
    for candidate in probe.CANDIDATES:
        drawn = probe.questions(candidate, 100, seed=0)
        assert len(set(drawn)) == len(drawn) == 100
        for a, b, answer in drawn:
            assert (
                candidate.a_range[0] <= a <= candidate.a_range[1] and candidate.b_range[0] <= b <= candidate.b_range[1]
            )
            assert answer == (a + b if candidate.op == "+" else a - b) >= 0
    assert probe.questions(probe.CANDIDATES[3], 100, seed=0) != probe.questions(probe.CANDIDATES[3], 100, seed=1)
    study = probe.study_candidate()
    study_prompts = {row["prompt"] for row in problems(ArithTaskConfig())}
    drawn = probe.questions(study, 1000, seed=0)
    assert len(drawn) == len(study_prompts) == 504  # the whole space when asked for more
    assert {study.user.format(a=a, b=b) for a, b, _ in drawn} == study_prompts
    assert study.system is ArithTaskConfig().system_prompt is None and study.budget == ArithTaskConfig().max_new_tokens
    # --task: another space of the study's task, prompt for prompt what `bapo study` would train on
    products = probe.task_candidate("*:2-12:2-19:64")
    space = ArithTaskConfig(ops=("*",), a_min=2, a_max=12, b_min=2, b_max=19)
    drawn = probe.questions(products, 1000, seed=0)
    assert {products.user.format(a=a, b=b) for a, b, _ in drawn} == {row["prompt"] for row in problems(space)}
    assert products.budget == 64 and all(answer == a * b for a, b, answer in drawn)
    for bad in ("*:2-12:2-19", "/:2-12:2-19:64", "+:9-2:2-19:64", "+:2-19:2-29:0", "-:2-5:10-20:64"):
        with pytest.raises(probe.argparse.ArgumentTypeError, match="OP:A_MIN-A_MAX:B_MIN-B_MAX:BUDGET"):
            probe.task_candidate(bad)


def test_task_probe_share_is_the_correct_length_share_of_each_mixed_group():
    """--share's identity: with group-normalised advantages a mixed group's positive share at ratio 1
    is Lc / (Lc + Lw) whatever its accuracy; uniform groups carry no signal and are left out."""
    probe = _task_probe()
    one_right = [(1.0, 10)] + [(0.0, 30)] * 7  # Lc 10, Lw 30: 0.25
    six_right = [(1.0, 20), (1.0, 10)] * 3 + [(0.0, 15), (0.0, 15)]  # Lc 15, Lw 15: 0.5
    all_wrong = [(0.0, 64)] * 8
    found = probe.share_at_ratio_one([one_right, six_right, all_wrong])
    assert found["mixed_groups"] == 2 and found["groups_below_target"] == 0.5
    # pooled: advantage x length summed over each sign. One right of 8: +sqrt(7) on the right reply,
    # -1/sqrt(7) on each wrong one; six right: +0.25/std and -0.75/std, std = sqrt(0.75 x 0.25)
    pos_one, neg_one = 7**0.5 * 10, 7 * 30 / 7**0.5
    std_six = (0.75 * 0.25) ** 0.5
    pos_six, neg_six = 0.25 / std_six * 90, 0.75 / std_six * 30
    assert found["pooled_share"] == pytest.approx((pos_one + pos_six) / (pos_one + neg_one + pos_six + neg_six))
    assert found["length_correct"] == pytest.approx((10 + 90) / 7) and found["length_wrong"] == pytest.approx(
        (210 + 30 + 512) / 17
    )
    assert probe.share_at_ratio_one([all_wrong])["mixed_groups"] == 0


@pytest.mark.parametrize("resume", [False, True])
def test_study_without_vllm_fails_in_one_line_before_any_work(tmp_path, monkeypatch, resume):
    from typer.testing import CliRunner

    import bapo.experiments.smollm2 as smollm2
    from bapo.cli.main import app
    from tests.train.test_cli import one_line_error, without_vllm

    without_vllm(monkeypatch)
    monkeypatch.setattr(smollm2, "convert", lambda *a, **k: pytest.fail("converted the model before the check"))
    study_dir = Path(__file__).resolve().parents[2] / "docs" / "study" / "full"  # a saved vLLM plan
    args = ["--resume", str(study_dir)] if resume else ["--quick", "--out", str(tmp_path / "quick")]
    line = one_line_error(CliRunner().invoke(app, ["study", *args]))
    assert "bapo study samples with vLLM: vLLM is not installed" in line and "`make vllm`" in line
    assert (f".venv/bin/bapo study --resume {study_dir}" if resume else ".venv/bin/bapo study") in line
    assert not (tmp_path / "quick").exists()


def test_study_task_option_sets_the_plans_space_and_refuses_a_bad_one(tmp_path, monkeypatch):
    """`bapo study --regime --task '*:2-19:2-29:64'`: the regime plan over products (the rest of its
    task kept), saved as given; a malformed or too small space is refused before any work."""
    from typer.testing import CliRunner

    import bapo.cli.study_cmd as study_cmd
    import bapo.experiments.smollm2 as smollm2
    import bapo.experiments.study as study
    from bapo.cli.main import app
    from bapo.experiments.arith import task_from_spec, task_spec

    plans = []
    monkeypatch.setattr(study_cmd, "check_vllm", lambda *a: None)
    monkeypatch.setattr(smollm2, "convert", lambda *a, **k: tmp_path / "model")

    def start(plan, *args, **kwargs):  # stands in for the runs: keep the plan, train nothing
        plans.append(plan)
        reused.append(kwargs.get("reuse"))
        raise RuntimeError("no runs in this test")

    reused: list = []

    monkeypatch.setattr(study, "run_study", start)

    def run(*args):
        return CliRunner().invoke(app, ["study", "--regime", "--out", str(tmp_path / "s"), *args])

    assert str(run("--task", "*:2-19:2-29:64", "--lr", "3e-6").exception) == "no runs in this test"
    (plan,) = plans
    assert plan.task == task_from_spec("*:2-19:2-29:64", PROFILES["regime"].task)
    assert (plan.task.ops, plan.task.max_new_tokens, plan.task.n_heldout, plan.lr) == (("*",), 64, 200, 3e-6)
    assert task_spec(plan.task) == "*:2-19:2-29:64" and task_spec(PROFILES["full"].task) == "+:2-19:2-29:10"
    both = task_from_spec("+*:2-19:2-29:64")
    assert both.ops == ("+", "*") and task_from_spec(task_spec(both)) == both
    for bad, message in (("*:2-12:2-19:64", "198 questions, not more than the 200 held out"), ("*:2-19", "OP:A_MIN")):
        result = run("--task", bad)
        assert result.exit_code == 2 and message in " ".join(result.output.replace("│", "").split())
    assert len(plans) == 1
    # --temperature: rollouts and held-out samples at verl's and TRL's 1.0; 0 is refused before any plan
    assert str(run("--temperature", "1.0").exception) == "no runs in this test"
    assert (plans[-1].temperature, PROFILES["regime"].temperature) == (1.0, 0.7)
    for bad in ("0", "-1", "inf"):
        result = run("--temperature", bad)
        line = " ".join(result.output.replace("│", "").split())
        assert result.exit_code == 2 and "a finite sampling temperature above 0 is required" in line, line
    assert len(plans) == 2
    # --partial / --segment-tokens: the methods also run with partial rollout; a typo is refused by name
    assert str(run("--methods", "grpo,opsm", "--partial", "grpo", "--segment-tokens", "8").exception) == (
        "no runs in this test"
    )
    assert (plans[-1].methods, plans[-1].partial_rollout_methods, plans[-1].segment_tokens) == (
        ("grpo", "opsm"),
        ("grpo",),
        8,
    )
    for args, message in (
        (("--partial", "bapo,gpro"), "--partial: gpro not among"),
        (("--partial", "grpo", "--segment-tokens", "64"), "segment_tokens=64: partial rollout needs a segment"),
    ):
        result = run(*args)
        assert result.exit_code == 2 and message in " ".join(result.output.replace("│", "").split())
    assert len(plans) == 3
    # --reuse DIR: passed on to the runs; a folder that is not a readable study is refused before any plan
    gate = tmp_path / "gate"
    (gate / "data").mkdir(parents=True)
    (gate / "study.json").write_text(json.dumps({"plan": PROFILES["regime"].to_json(), "runs": {}}))
    for split in ("train.jsonl", "heldout.jsonl"):
        (gate / "data" / split).write_text("")
    assert str(run("--reuse", str(gate)).exception) == "no runs in this test"
    assert reused[-1] == (gate,) and reused[0] == ()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "study.json").write_text("{}")
    (gate / "data" / "heldout.jsonl").unlink()
    for folder, message in (
        ("nothing", "not a bapo study folder (no study.json)"),
        ("empty", "not a bapo study folder (its study.json holds no valid plan"),
        ("gate", "its task split data/heldout.jsonl is missing"),
    ):
        result = run("--reuse", str(tmp_path / folder))
        line = " ".join(result.output.replace("│", "").split())
        assert result.exit_code == 2 and message in line, line
    result = run("--segment-tokens", "8")
    line = " ".join(result.output.replace("│", "").split())
    assert result.exit_code == 2 and "--segment-tokens sets --partial's segment: give --partial METHODS" in line
    assert len(plans) == 4

    # a model that cannot be converted: one line naming it and the converter's reason, no plan run
    def no_gguf(*args, **kwargs):
        raise ValueError("reading GGUF files needs the gguf package: pip install 'bapo[real]'")

    monkeypatch.setattr(smollm2, "convert", no_gguf)
    result = run()
    line = " ".join(result.output.replace("│", "").split())
    assert result.exit_code == 2 and "bapo study needs SmolLM2-135M-Instruct converted (reading GGUF" in line, line
    assert len(plans) == 4
    # --lora-rank without peft: one line before any work (the model is not converted, no plan is made)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    monkeypatch.setattr(smollm2, "convert", lambda *a, **k: pytest.fail("converted the model before the check"))
    result = run("--lora-rank", "1", "--lr", "1e-4")
    assert result.exit_code == 2 and "--lora-rank 1 needs peft" in " ".join(result.output.replace("│", "").split())
    assert len(plans) == 4


def test_paired_lift_reads_each_seeds_lift_and_pairs_by_seed(capsys, monkeypatch):
    """scripts/paired_lift.py on the committed regime records: the lifts the gate prints, per seed,
    and a folder against itself differs by exactly 0 over every seed."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "scripts" / "paired_lift.py"
    spec = importlib.util.spec_from_file_location("paired_lift", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = Path(__file__).resolve().parents[2] / "docs" / "study" / "regime-lr3e-6"
    lifts = module.lifts(folder)
    assert sorted(lifts) == [0, 1, 2] and all(0.3 < lift < 0.6 for lift in lifts.values())
    monkeypatch.setattr(sys, "argv", ["paired_lift.py", str(folder), str(folder)])
    module.main()
    assert "A - B, paired over seeds 0, 1, 2: +0.000 [+0.000, +0.000]" in capsys.readouterr().out


def test_resume_on_a_new_machine_rebuilds_the_converted_model_at_its_saved_path(tmp_path, monkeypatch):
    """`bapo study --resume DIR` where DIR's study.json names a converted SmolLM2 folder this machine
    lacks (a clone of committed records): the folder is rebuilt at that path before the runs; a
    rebuild that fails is one line naming the path."""
    from typer.testing import CliRunner

    import bapo.cli.study_cmd as study_cmd
    import bapo.experiments.smollm2 as smollm2
    import bapo.experiments.study as study
    from bapo.cli.main import app

    saved = tmp_path / "elsewhere" / smollm2.FOLDER  # the path a study.json from another machine holds
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    record = json.loads((Path(__file__).resolve().parents[2] / "docs/study/regime-mul-lr3e-6/study.json").read_text())
    record["plan"]["model"] = str(saved)
    (study_dir / "study.json").write_text(json.dumps(record))
    converted: list[Path] = []

    def fake_convert(out=None, gguf_file=None):
        converted.append(Path(out))
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    def start(plan, *args, **kwargs):  # stands in for the runs
        raise RuntimeError(f"runs on {plan.model}")

    monkeypatch.setattr(study_cmd, "check_vllm", lambda *a: None)
    monkeypatch.setattr(study, "run_study", start)
    monkeypatch.setattr(smollm2, "convert", fake_convert)
    result = CliRunner().invoke(app, ["study", "--resume", str(study_dir)])
    assert str(result.exception) == f"runs on {saved}" and converted == [saved]
    CliRunner().invoke(app, ["study", "--resume", str(study_dir)])  # present now: not converted again
    assert converted == [saved]

    def unwritable(out=None, gguf_file=None):
        raise PermissionError(13, "Permission denied", str(out))

    monkeypatch.setattr(smollm2, "convert", unwritable)
    record["plan"]["model"] = str(tmp_path / "other" / smollm2.FOLDER)
    (study_dir / "study.json").write_text(json.dumps(record))
    result = CliRunner().invoke(app, ["study", "--resume", str(study_dir)])
    line = " ".join(result.output.replace("│", "").split())
    assert result.exit_code == 2 and "is missing and could not be rebuilt there" in line and "Permission denied" in line


def test_regime_gate_script_refuses_a_saved_folder_of_another_task_or_temperature_before_any_run():
    """scripts/regime_gate.sh on the committed products folder (task *:2-19:2-29:64, temperature 0.7):
    a TASK or TEMPERATURE (or, unset, the regime plan's) other than the saved one stops it in one line
    with exit 2; the saved one passes the check (ROUNDS=0: no run)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]

    def gate(**env):
        settings = {"LRS": "3e-6", "ROUNDS": "0", "TAG": "mul", "PYTHON": sys.executable, "BAPO": "false", **env}
        return subprocess.run(
            ["bash", "scripts/regime_gate.sh"], cwd=repo, env={**os.environ, **settings}, capture_output=True, text=True
        )

    assert gate(TASK="*:2-19:2-29:64").returncode == 0
    assert gate(TASK="*:2-19:2-29:64", TEMPERATURE="0.7").returncode == 0
    for env, message in (
        ({"TASK": "+:2-19:2-29:64"}, "holds task *:2-19:2-29:64, not +:2-19:2-29:64: use another TAG"),
        ({"TEMPERATURE": "0.7"}, "not +:2-19:2-29:64 (unset: the regime plan's): use another TAG"),
        ({"TASK": "*:2-19:2-29:64", "TEMPERATURE": "1.0"}, "holds temperature 0.7, not 1.0: use another TAG"),
        ({"TASK": "*:2-19:2-29:64", "TEMPERATURE": "hot"}, "TEMPERATURE=hot: a number above 0 expected"),
        ({"TAG": "", "TEMPERATURE": "1.0"}, "TASK or TEMPERATURE goes with TAG"),
    ):
        result = gate(**env)
        assert result.returncode == 2 and message in result.stderr, (env, result.stderr)
