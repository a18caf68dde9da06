"""The mechanism lab: exact tabular quantities, the trainer's off-policy schedule, claims computed
from the runs, and the `bapo lab` command. Tiny settings: the whole file runs in seconds."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.lab.claims import lab_claims
from bapo.lab.policy import (
    GuessTask,
    exact_stats,
    sample,
    state_entropy,
    token_entropy,
    token_log_probs,
)
from bapo.lab.run import Cell, LabConfig, run_cell
from bapo.train.buffer import minibatch_order
from bapo.train.config import ConfigError

TINY = LabConfig(
    task=GuessTask(prompts=3, vocab=6, budget=4, answer_prob=(0.05, 0.2)),
    group_size=4,
    rollout_steps=3,
    seeds=3,
    lr=100.0,
    check_cells=("grpo E=2",),
)


def test_instance_sets_the_answer_probability_exactly():
    task = GuessTask(prompts=4, vocab=10, budget=3, answer_prob=(0.01, 0.05))
    logits, answers = task.instance(seed=5)
    prob = torch.softmax(logits, -1)[torch.arange(4), :, answers]  # [P, D]
    assert ((prob >= 0.01 - 1e-12) & (prob <= 0.05 + 1e-12)).all()
    assert torch.allclose(prob, prob[:, :1].expand_as(prob))  # the same q_p at every depth
    assert torch.equal(task.instance(5)[0], logits) and not torch.equal(task.instance(6)[0], logits)


def test_log_probs_and_entropy_match_a_direct_computation():
    logits = torch.randn(2, 3, 4, 5, dtype=torch.float64)  # [S, P, D, V]
    prompt = torch.tensor([[0, 2], [1, 1]])
    tokens = torch.randint(5, (2, 2, 4))
    mask = torch.tensor([[[1, 1, 0, 0], [1, 1, 1, 1]], [[1, 0, 0, 0], [1, 1, 1, 0]]], dtype=torch.bool)
    got = token_log_probs(logits, prompt, tokens)
    entropy = token_entropy(logits, prompt, mask)
    for s, b, t in itertools.product(range(2), range(2), range(4)):
        z = logits[s, prompt[s, b], t].tolist()
        norm = math.log(sum(math.exp(v) for v in z))
        assert got[s, b, t].item() == pytest.approx(z[tokens[s, b, t]] - norm, abs=1e-12)
    for s in range(2):
        values = []
        for b, t in itertools.product(range(2), range(4)):
            if mask[s, b, t]:
                p = torch.softmax(logits[s, prompt[s, b], t], -1).tolist()
                values.append(-sum(x * math.log(x) for x in p))
        assert entropy[s].item() == pytest.approx(sum(values) / len(values), abs=1e-12)
    assert state_entropy(logits).shape == (2, 3, 4)


def test_exact_stats_match_enumeration_of_every_response():
    """Expected reward, length and on-policy token entropy against a sum over all V^D sequences."""
    task = GuessTask(prompts=2, vocab=3, budget=3, answer_prob=(0.1, 0.4))
    logits, answers = task.instance(seed=1)
    stats = exact_stats(logits[None], answers[None])
    pi = torch.softmax(logits, -1)
    entropy = state_entropy(logits[None])[0]
    rewards, lengths, entropy_sums = [], [], []
    for p in range(2):
        # every response: guesses until the first correct one or the budget, with its probability
        responses = [((), 1.0)]
        finished = []
        while responses:
            seq, prob = responses.pop()
            if len(seq) == 3 or (seq and seq[-1] == answers[p].item()):
                finished.append((seq, prob))
                continue
            responses += [(seq + (v,), prob * pi[p, len(seq), v].item()) for v in range(3)]
        assert sum(prob for _, prob in finished) == pytest.approx(1.0)
        rewards.append(sum(prob for seq, prob in finished if answers[p].item() in seq))
        lengths.append(sum(prob * len(seq) for seq, prob in finished))
        entropy_sums.append(sum(prob * sum(entropy[p, j].item() for j in range(len(seq))) for seq, prob in finished))
    assert stats["reward"].item() == pytest.approx(sum(rewards) / 2, abs=1e-12)
    assert stats["length"].item() == pytest.approx(sum(lengths) / 2, abs=1e-12)
    assert stats["entropy"].item() == pytest.approx(sum(entropy_sums) / sum(lengths), abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.0, 30.0), budget=st.integers(1, 6))
def test_exact_stats_stay_in_range_for_any_logits(seed, scale, budget):
    """Reward in [0, 1], expected length in [1, D], entropy in [0, log V], also for extreme logits."""
    logits = scale * torch.randn(2, 3, budget, 7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    answers = torch.randint(7, (2, 3), generator=torch.Generator().manual_seed(seed + 1))
    stats = exact_stats(logits, answers)
    assert ((stats["reward"] >= 0) & (stats["reward"] <= 1 + 1e-12)).all()
    assert ((stats["length"] >= 1 - 1e-12) & (stats["length"] <= budget + 1e-12)).all()
    assert ((stats["entropy"] >= 0) & (stats["entropy"] <= math.log(7) + 1e-12)).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), group=st.integers(1, 5))
def test_sampled_responses_stop_at_the_first_correct_guess(seed, group):
    task = GuessTask(prompts=3, vocab=4, budget=5, answer_prob=(0.2, 0.5))
    logits, answers = task.instance(seed)
    drawn = sample(logits[None], answers[None], group, [torch.Generator().manual_seed(seed)])
    tokens, mask, rewards = drawn["tokens"][0], drawn["mask"][0], drawn["rewards"][0]
    answer = answers[drawn["prompt"][0]]
    for b in range(tokens.shape[0]):
        length = int(mask[b].sum())
        hits = [t for t in range(5) if tokens[b, t] == answer[b]]
        assert length == (hits[0] + 1 if hits else 5)
        assert rewards[b].item() == float(bool(hits))
        assert mask[b, :length].all()
    assert torch.allclose(drawn["log_prob"], token_log_probs(logits[None], drawn["prompt"], drawn["tokens"]))


def test_minibatch_order_partitions_the_batch_per_epoch():
    updates = minibatch_order(12, 3, 2, seed=4, step=7)
    assert [e for e, _ in updates] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        rows = torch.cat([r for e, r in updates if e == epoch])
        assert sorted(rows.tolist()) == list(range(12))
    assert all(torch.equal(r, r.sort().values) for _, r in updates)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(updates, minibatch_order(12, 3, 2, seed=4, step=7)))
    assert [r.tolist() for _, r in minibatch_order(5, 1, 1, 0, 0)] == [[0, 1, 2, 3, 4]]


def test_staleness_E_runs_E_plus_1_updates_on_each_batch():
    run = run_cell(Cell("grpo", staleness_e=2), TINY)
    assert run.updates["grad_norm"].shape == (3, 3 * 3)
    # batch of rollout step s generated by version 3s; its m-th update is m versions later
    assert run.versions == [0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert run.updates["policy_lag/mean"][0].tolist() == [0, 1, 2] * 3


def test_async_delay_trains_each_batch_once_k_steps_late():
    run = run_cell(Cell("grpo", async_delay=2), LabConfig(**{**TINY.__dict__, "rollout_steps": 5}))
    # warm-up: the first 2 batches come from the start policy (version 0), as in Trainer.fit
    assert run.versions == [0, 0, 0, 1, 2]
    assert run.updates["policy_lag/mean"][0].tolist() == [0, 1, 2, 2, 2]


def test_on_policy_first_update_never_clips():
    run = run_cell(Cell("grpo", staleness_e=2), TINY)
    assert run.updates["clip_frac"][:, ::3].abs().max() == 0.0  # ratio is exactly 1 on fresh data


def test_no_signal_updates_have_no_share():
    """Every response solved: all advantages are 0, nothing moves, and the share is missing (NaN), not 1."""
    solved = LabConfig(**{**TINY.__dict__, "task": GuessTask(prompts=3, vocab=6, budget=4, answer_prob=(0.98, 0.99))})
    run = run_cell(Cell("grpo", staleness_e=2), solved)
    assert run.updates["positive_share"].isnan().all() and run.updates["entropy_change_estimate"].isnan().all()
    assert (run.updates["grad_norm"] == 0).all() and (run.updates["entropy/batch_change"] == 0).all()


def test_runs_are_deterministic_per_seed():
    both = run_cell(
        Cell("bapo", staleness_e=1), LabConfig(**{**TINY.__dict__, "seeds": 2, "first_seed": 0, "group_size": 4})
    )
    alone = run_cell(Cell("bapo", staleness_e=1), LabConfig(**{**TINY.__dict__, "seeds": 1, "first_seed": 1}))
    for key, series in alone.updates.items():
        assert torch.allclose(both.updates[key][1], series[0], equal_nan=True), key


def test_bad_cells_fail_with_the_field():
    with pytest.raises(ConfigError, match="mini_batches"):
        run_cell(Cell("grpo", staleness_e=4), TINY)  # 5 does not divide 3 * 4 rows
    with pytest.raises(ValueError, match="method"):
        run_cell(Cell("ppo"), TINY)


def _claims(config: LabConfig, cells: list[Cell]):
    runs = [run_cell(c, config) for c in cells]
    return {c.id: c for c in lab_claims(runs, config.rollout_steps)}


def test_claims_come_from_the_runs():
    """Failures longer than successes give a positive share below 0.5 (claim 3 held); with a budget of
    one guess every response has length 1 and the share is exactly 0.5, so the verdict flips."""
    cells = [Cell("grpo", 0), Cell("grpo", 2)]
    longer = _claims(TINY, cells)
    assert longer["3-negative-dominate"].verdict == "held"
    equal = _claims(
        LabConfig(**{**TINY.__dict__, "task": GuessTask(prompts=3, vocab=6, budget=1, answer_prob=(0.2, 0.5))}), cells
    )
    assert equal["3-negative-dominate"].verdict == "mixed"
    assert equal["3-negative-dominate"].effect == 0.0  # exactly 0.5, up to float rounding
    # no learning at all: no entropy difference between E = 0 and E = 2
    frozen = _claims(LabConfig(**{**TINY.__dict__, "lr": 1e-12}), cells)
    assert frozen["1-entropy-E2-samples"].verdict == "mixed"
    assert longer["1-entropy-E2-samples"].effect != frozen["1-entropy-E2-samples"].effect


def test_bapo_lab_quick_json_runs(tmp_path):
    from typer.testing import CliRunner

    from bapo.cli.main import app

    result = CliRunner().invoke(
        app, ["lab", "--quick", "--json", "--seeds", "2", "--jobs", "1", "--no-plots", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {"id", "verdict", "effect", "interval", "seeds", "held"} <= set(rows[0])
    assert any(r["id"] == "3-negative-dominate" for r in rows) and all(r["seeds"] == 2 for r in rows)
    assert (tmp_path / "claims.json").exists() and (tmp_path / "report.md").exists()
    metrics = (tmp_path / "cells" / "grpo_E=4" / "metrics.jsonl").read_text().splitlines()
    first = json.loads(metrics[0])
    assert len(metrics) == 2 * 12 * 5 and first["seed"] == 0 and first["E"] == 4 and first["async_delay"] == 0


def test_bapo_lab_rejects_one_seed():
    from typer.testing import CliRunner

    from bapo.cli.main import app

    result = CliRunner().invoke(app, ["lab", "--seeds", "1"])
    assert result.exit_code != 0 and "seeds" in result.output


@pytest.mark.parametrize("args", [["--stale-k"], ["--stale-k", "--seeds", "2"], ["--peers", "--stale-k"]])
def test_bapo_lab_refuses_the_renamed_stale_k_flag_in_one_line_naming_its_replacement(args, monkeypatch):
    """`--stale-k` was renamed `--async-delays`: refused in one line, before any run (never read as the
    new flag), whatever else is on the command line; --help no longer lists it."""
    from typer.testing import CliRunner

    import bapo.lab.lab
    from bapo.cli.main import app

    monkeypatch.setattr(bapo.lab.lab, "run_lab", lambda *a, **k: pytest.fail("a refused flag must not run the lab"))
    result = CliRunner().invoke(app, ["lab", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: --stale-k was renamed --async-delays") and "Traceback" not in result.output
    help_text = CliRunner().invoke(app, ["lab", "--help"]).output
    assert "--async-delays" in help_text and "--stale-k" not in help_text


def test_lab_claims_equal_those_of_the_engine_before_it_was_data():
    from tests.analysis.test_claims_engine import assert_same_claims
    from tests.lab.synthetic import ROLLOUT_STEPS, synthetic_runs

    golden = Path(__file__).parent / "fixtures" / "claims_before_engine.json"
    assert_same_claims(lab_claims(synthetic_runs(), ROLLOUT_STEPS), golden)


def test_lab_report_uses_the_analysis_stack(tmp_path):
    """The lab's folder reads back as one run per cell and seed (bapo compare / bapo plot work on
    it); report.md has the claims, a leaderboard of every method run and the plots."""
    from bapo.analysis.runs import find_runs
    from bapo.lab.lab import LabPlan, run_lab

    plan = LabPlan(LabConfig(**{**TINY.__dict__, "seeds": 2}), methods=("grpo", "bapo"), staleness_e=(0, 2), delays=())
    plan = dataclasses.replace(plan, claim2_staleness_e=())
    claims, out = run_lab(tmp_path, plan=plan, jobs=1)
    runs = find_runs([out / "cells"])
    assert sorted((r.method, r.setting, r.seed) for r in runs) == sorted(
        (m, f"E={e}", s) for m in ("grpo", "bapo") for e in (0, 2) for s in (0, 1)
    )
    assert all(len(r.rows) == 3 * (3 if r.setting == "E=2" else 1) for r in runs)
    bapo = next(r for r in runs if r.method == "bapo")
    assert "bapo/search/reached" in bapo.rows[0] and "bapo/reached" not in bapo.rows[0]
    report = (out / "report.md").read_text()
    assert claims and claims[0].id in report
    assert "| E=2 | bapo |" in report and "(baseline)" in report  # the leaderboard
    for figure in ("entropy", "positive_share", "reward"):
        for name in (figure, f"{figure}_grpo_over_E"):  # per setting; GRPO's E=0 vs E=2 at equal samples
            assert (out / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
            assert f"plots/{name}.png" in report


def test_a_method_added_to_METHODS_joins_the_default_plan(monkeypatch):
    """The default plan runs every method but claim 2's bound variants (the same cells as before
    the list was derived); one more METHODS line adds its cells at every E."""
    from bapo.lab import run
    from bapo.lab.lab import LabPlan

    expected = ("grpo", "clip-higher", "dual-clip", "bapo") + (
        ("bapo-entropy",) if "bapo-entropy" in run.METHODS else ()
    )
    assert LabPlan().methods == expected
    monkeypatch.setitem(run.METHODS, "m2po", ("grpo", {}))
    plan = LabPlan()
    assert plan.methods[-1] == "m2po" and {Cell("m2po", e) for e in plan.staleness_e} <= set(plan.cells())


@pytest.mark.parametrize(
    "method", ["gspo", "cispo", "sapo", "gmpo", "clip-cov", "kl-cov", "m2po", "m2po-official", "dppo-tv", "dppo-kl"]
)
def test_any_registered_loss_runs_by_name_and_each_seed_alone(method):
    """A registered loss outside METHODS runs as Cell(<its name>) with its defaults; losses that
    select over the batch (BATCH_LEVEL_METHODS) select per seed, so a seed's run does not depend
    on the others in the cell."""
    both = run_cell(Cell(method, staleness_e=1), TINY)
    alone = run_cell(Cell(method, staleness_e=1), LabConfig(**{**TINY.__dict__, "seeds": 1, "first_seed": 1}))
    assert torch.isfinite(both.updates["grad_norm"]).all() and torch.isfinite(both.updates["exact/entropy"]).all()
    for key, series in alone.updates.items():
        assert torch.allclose(both.updates[key][1], series[0], equal_nan=True), key


def test_decoupled_ppo_in_the_lab_clips_against_the_policy_before_the_batch():
    """Without an async delay the proximal policy (before the batch's first update) is the behaviour
    policy: decoupled PPO is grpo exactly, at E = 2 too. With a delay they differ."""
    same = run_cell(Cell("decoupled-ppo", staleness_e=2), TINY).updates
    grpo = run_cell(Cell("grpo", staleness_e=2), TINY).updates
    assert torch.allclose(same["exact/reward"], grpo["exact/reward"], atol=1e-9)
    stale = run_cell(Cell("decoupled-ppo", async_delay=2), TINY).updates
    stale_grpo = run_cell(Cell("grpo", async_delay=2), TINY).updates
    assert torch.isfinite(stale["grad_norm"]).all()
    assert not torch.allclose(stale["exact/reward"], stale_grpo["exact/reward"])


@pytest.mark.parametrize("method", ["icepop", "opsm"])
def test_icepop_and_opsm_are_grpo_until_the_data_is_stale(method, monkeypatch):
    """Without an async delay the behaviour policy is the one before the batch's first update:
    IcePop's weight pi_prox / mu is 1 (inside [0.5, 5]) and grpo runs unchanged; OPSM's mean
    log(mu / pi) is 0 at the first update, and its later updates drop a response only once its
    policy moved by more than 0.5 nats on average. With a delay both differ from grpo."""
    from bapo.lab import run as lab_run

    if method == "icepop":
        same = run_cell(Cell(method, staleness_e=2), TINY).updates
        grpo = run_cell(Cell("grpo", staleness_e=2), TINY).updates
        assert torch.allclose(same["exact/reward"], grpo["exact/reward"], atol=1e-9)
    stale = run_cell(Cell(method, async_delay=2), TINY).updates
    assert torch.isfinite(stale["grad_norm"]).all() and torch.isfinite(stale["exact/entropy"]).all()
    assert not torch.allclose(
        stale["exact/reward"], run_cell(Cell("grpo", async_delay=2), TINY).updates["exact/reward"]
    )
    seen = []
    real = lab_run.policy_loss

    def spy(*args, importance_weights=None, **kwargs):
        seen.append(importance_weights)
        return real(*args, importance_weights=importance_weights, **kwargs)

    monkeypatch.setattr(lab_run, "policy_loss", spy)
    run_cell(Cell(method, async_delay=2), TINY)
    weights = torch.cat([w.flatten() for w in seen])
    assert bool((weights == 0).any())  # the mask acts on stale data
    if method == "opsm":
        assert set(weights.unique().tolist()) <= {0.0, 1.0}


def test_peers_plan_runs_every_lab_method_at_every_setting():
    """`bapo lab --peers`: every registered loss the lab runs (decoupled-ppo too), at E 0/2/4/8 and
    async delay 2/4/8/16/64, no claim-2 variants; the default plan is unchanged."""
    from bapo.core import POLICY_LOSSES
    from bapo.lab.lab import LabPlan, peer_methods, plan_for
    from bapo.lab.run import WEIGHTED_METHODS

    methods = peer_methods()
    assert set(methods) == set(POLICY_LOSSES) | {"icepop", "opsm"} == set(POLICY_LOSSES) | set(WEIGHTED_METHODS)
    assert methods[0] == "grpo" and {"dppo-tv", "dppo-kl"} <= set(methods)
    plan = plan_for(peers=True)
    assert plan.config.seeds == 20 and plan_for(peers=True, seeds=3).config.seeds == 3
    settings = ["E=0", "E=2", "E=4", "E=8"] + [f"E=0, async delay {k}" for k in (2, 4, 8, 16, 64)]
    assert plan.settings() == settings
    assert sorted(c.name for c in plan.cells()) == sorted(
        Cell(m, e, k).name
        for m in methods
        for e, k in [(0, 0), (2, 0), (4, 0), (8, 0)] + [(0, k) for k in (2, 4, 8, 16, 64)]
    )
    assert plan_for() == LabPlan()  # the default lab is unchanged
    with pytest.raises(ValueError, match="choose one"):
        plan_for(quick=True, peers=True)


def test_peers_leaderboards_rank_every_method_in_every_setting(tmp_path, monkeypatch):
    """A tiny peers run (2 seeds, 3 batches, E 0 and 2, delay 2): one row per method and setting
    with a finite mean in every leaderboard (the share one: the clipped methods only), each vs grpo;
    printed by `bapo lab --peers`, written to report.md and claims.json."""
    from bapo.lab.lab import PEER_SHARE_METHODS, peer_methods, peers_plan, plan_leaderboards, run_cell, run_lab

    plan = peers_plan(LabConfig(**{**TINY.__dict__, "seeds": 2}), staleness_e=(0, 2), delays=(2,))
    methods, settings = peer_methods(), ["E=0", "E=2", "E=0, async delay 2"]
    runs = [run_cell(cell, plan.config) for cell in plan.cells()]
    boards = plan_leaderboards(runs, plan)
    assert [metric for metric, _, _ in boards] == [
        "reward at the end",
        "mean reward",
        "entropy at the end",
        "entropy at matched reward",
        "grad-norm CV",
        "share distance",
    ]
    for metric, _, standings in boards:
        expected = PEER_SHARE_METHODS if metric == "share distance" else methods
        assert sorted((r.setting, r.method) for r in standings) == sorted((s, m) for s in settings for m in expected)
        if metric == "entropy at matched reward":  # a seed that never reaches the reward level is left out
            assert all(r.seeds <= 2 and (r.seeds == 0 or math.isfinite(r.mean)) for r in standings)
        else:
            assert all(math.isfinite(r.mean) and r.seeds == 2 for r in standings), metric
        assert all((r.versus is None) == (r.method == "grpo") for r in standings)
    cv = [r.mean for r in boards[4][2] if r.setting == "E=2"]
    assert cv == sorted(cv)  # lower is better: ranked ascending

    from typer.testing import CliRunner

    from bapo.cli.main import app

    help_text = CliRunner().invoke(app, ["lab", "--help"]).output
    assert "--peers" in help_text
    result = CliRunner().invoke(app, ["lab", "--peers", "--quick"])
    assert result.exit_code != 0 and "choose one" in result.output

    claims, out = run_lab(
        tmp_path, plan=peers_plan(plan.config, ("grpo", "bapo", "gspo"), (0,), (2,)), jobs=1, plots=False
    )
    report, board = (out / "report.md").read_text(), (out / "leaderboards.md").read_text()
    assert "### grad-norm CV" in report and "| E=0, async delay 2 | gspo |" in board and board in report
    ids = {row["id"] for row in json.loads((out / "claims.json").read_text())}
    assert "mean reward-gspo-vs-grpo-E=0, async delay 2" in ids and {c.id for c in claims} < ids

    import bapo.lab.lab

    small = peers_plan(plan.config, ("grpo", "m2po"), (0,), ())
    monkeypatch.setattr(bapo.lab.lab, "plan_for", lambda *args, **kwargs: small)  # `bapo lab --peers`, tiny
    result = CliRunner().invoke(
        app, ["lab", "--peers", "--json", "--jobs", "1", "--no-plots", "--out", str(tmp_path / "c")]
    )
    assert result.exit_code == 0, result.output
    assert "m2po" in result.output and json.loads(result.output) == json.loads(
        (tmp_path / "c" / "claims.json").read_text()
    )
    printed = CliRunner().invoke(app, ["lab", "--peers", "--jobs", "1", "--no-plots", "--out", str(tmp_path / "p")])
    assert printed.exit_code == 0, printed.output
    assert "bapo lab --peers: leaderboards" in printed.output and "| E=0 | m2po |" in printed.output
    assert (tmp_path / "p" / "leaderboards.md").read_text() in printed.output


def test_async_delay_plan_runs_long_with_an_unclipped_surrogate():
    """`bapo lab --async-delays`: six methods at async delay 4/16/64/256 for 384 rollout steps, 10 seeds;
    "unclipped" is the plain surrogate -r A (no trust region: extreme ratios pass untouched)."""
    from bapo.core import policy_loss
    from bapo.lab.lab import ASYNC_DELAY_METHODS, async_delay_plan, plan_for, plan_leaderboards
    from bapo.lab.run import method_loss

    plan = plan_for(async_delays=True)
    assert plan.methods == ASYNC_DELAY_METHODS and "unclipped" in plan.methods
    assert (plan.config.rollout_steps, plan.config.seeds) == (384, 10)
    assert plan.settings() == ["E=0"] + [f"E=0, async delay {k}" for k in (4, 16, 64, 256)]
    with pytest.raises(ValueError, match="choose one"):
        plan_for(peers=True, async_delays=True)

    torch.manual_seed(0)
    log_prob, old = torch.randn(4, 6), torch.randn(4, 6) * 4  # ratios far outside any clip range
    advantages, mask = torch.randn(4, 6), torch.ones(4, 6, dtype=torch.bool)
    name, params = method_loss("unclipped")
    loss, _ = policy_loss(log_prob, old, advantages, mask, name, **params)
    assert torch.allclose(loss, -(torch.exp(log_prob - old) * advantages).mean())

    tiny = async_delay_plan(LabConfig(**{**TINY.__dict__, "seeds": 2, "rollout_steps": 8}), delays=(2,))
    runs = [run_cell(cell, tiny.config) for cell in tiny.cells()]
    boards = plan_leaderboards(runs, tiny)
    assert [metric for metric, _, _ in boards] == [
        "early reward",
        "reward at the end",
        "reward drawdown",
        "entropy at the end",
        "entropy at matched reward",
    ]
    for metric, _, standings in boards:
        assert sorted((r.setting, r.method) for r in standings) == sorted(
            (s, m) for s in ("E=0", "E=0, async delay 2") for m in ASYNC_DELAY_METHODS
        )
        matched = metric == "entropy at matched reward"  # seeds that never reach the level are left out
        assert all((r.seeds <= 2) if matched else (r.seeds == 2 and math.isfinite(r.mean)) for r in standings)
    unclipped = next(r for r in runs if r.cell.name == "unclipped E=0 delay=2").updates["exact/reward"]
    grpo = next(r for r in runs if r.cell.name == "grpo E=0 delay=2").updates["exact/reward"]
    assert not torch.allclose(unclipped, grpo)  # stale ratios: the clip matters
    # one update per batch: decoupled PPO's proximal policy is the current one (r' = 1) and its weight
    # pi_prox / mu is uncapped, so its updates are the unclipped surrogate's (docs/LAB.md)
    decoupled = next(r for r in runs if r.cell.name == "decoupled-ppo E=0 delay=2").updates["exact/reward"]
    assert torch.allclose(decoupled, unclipped, atol=1e-9)
