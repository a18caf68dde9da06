"""The regime lab's mechanics (bapo.lab.regimes and the LabConfig / GuessTask fields it sets)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from bapo.core import BAPOConfig
from bapo.lab.policy import GuessTask, exact_stats, guess_positions, sample, state_entropy
from bapo.lab.regimes import PRIOR_SCALES, REGIME_CELLS, Regime, regime_claims, run_regimes
from bapo.lab.run import (
    METHODS,
    STAGE_BOTH,
    STAGE_C_HIGH,
    STAGE_C_LOW,
    Cell,
    LabConfig,
    LabPolicy,
    entropy_split,
    method_loss,
    run_cell,
)

TINY = LabConfig(task=GuessTask(prompts=3, vocab=8, budget=3), group_size=5, rollout_steps=3, seeds=2)


def test_filler_positions_do_not_change_the_reward():
    """A filler task's guess positions are the k = 0 task's logits; the exact reward reads only
    them (any change of the filler logits leaves it equal, a change of a guess logit does not), and
    a sampled response is rewarded iff one of its guess tokens is the answer."""
    task, plain = GuessTask(filler=2), GuessTask()
    logits, answers = task.instance(3)
    assert logits.shape[1] == task.positions == 3 * plain.budget
    guess = guess_positions(task.positions, 2)
    assert torch.equal(logits[:, guess], plain.instance(3)[0]) and torch.equal(answers, plain.instance(3)[1])
    reward = exact_stats(logits[None], answers[None], filler=2)["reward"]
    assert torch.allclose(reward, exact_stats(plain.instance(3)[0][None], answers[None])["reward"])
    shuffled = logits.clone()
    shuffled[:, ~guess] = 5.0 * torch.randn_like(shuffled[:, ~guess])
    assert torch.equal(exact_stats(shuffled[None], answers[None], filler=2)["reward"], reward)
    moved = logits.clone()
    moved[0, 2, answers[0]] += 3.0  # the first guess of prompt 0
    assert not torch.allclose(exact_stats(moved[None], answers[None], filler=2)["reward"], reward)
    drawn = sample(logits[None], answers[None], 64, [torch.Generator().manual_seed(0)], filler=2)
    tokens, mask = drawn["tokens"][0], drawn["mask"][0]
    hit = (tokens == answers[drawn["prompt"][0]][:, None]) & guess
    assert torch.equal(drawn["rewards"][0].bool(), hit.any(1))
    # a response stops right after its first correct guess, and a filler hit never stops it
    last = mask.sum(1) - 1
    assert torch.equal(guess[last] | ~drawn["rewards"][0].bool(), torch.ones_like(last, dtype=torch.bool))
    stats = exact_stats(logits[None], answers[None], filler=2)
    assert {"entropy/guess", "entropy/filler"} <= stats.keys()


def test_peakedness_sets_the_start_entropy():
    """The start logits' spread moves the start entropy from ~3 nats (the default) to below 1."""
    entropies = []
    for scale in PRIOR_SCALES:
        task = GuessTask(prior_scale=scale, filler=2)
        entropies.append(float(state_entropy(torch.stack([task.instance(s)[0] for s in range(4)])).mean()))
    assert all(a > b for a, b in zip(entropies, entropies[1:]))
    assert 2.8 < entropies[0] < 3.2 and entropies[-1] < 1.0
    assert Regime(prior_scale=6.0).config(LabConfig()).task.prior_scale == 6.0


def test_shared_parameters_move_other_states_the_table_does_not():
    """A gradient on one state's logits: the table moves that state only; the shared parameters
    (prompt, position and state blocks) move every state of its prompt and of its position too,
    and no state of another prompt at another position. Both start at the prior."""
    prior = TINY.task.instance(0)[0][None].clone()
    for parameters in ("table", "shared"):
        policy = LabPolicy(prior, replace(TINY, parameters=parameters, lr=1.0))
        assert torch.equal(policy.logits().detach(), prior)
        logits = policy.logits()
        (logits[0, 1, 2, 3] * 1.0).backward()
        policy.step(torch.ones(1, dtype=prior.dtype))
        moved = (policy.logits().detach() - prior).abs().sum(-1)[0] > 0  # [P, L]
        if parameters == "table":
            assert moved.sum() == 1 and moved[1, 2]
        else:
            assert moved[1].all() and moved[:, 2].all()  # its prompt's states and its position's
            assert not moved[0, 0] and not moved[2, 1]


def test_adam_path_is_torch_adam_per_seed():
    """LabPolicy's Adam equals torch.optim.Adam (its defaults) on the same gradients, and a seed's
    steps do not depend on the other seeds' gradients."""
    prior = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    policy = LabPolicy(prior, replace(TINY, optimizer="adam", lr=0.05))
    reference = prior.clone().requires_grad_(True)
    torch_adam = torch.optim.Adam([reference], lr=0.05)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grad = torch.randn(prior.shape, generator=generator, dtype=torch.float64)
        policy.params[0].grad = grad.clone()
        policy.step(torch.ones(2, dtype=torch.float64))
        reference.grad = grad.clone()
        torch_adam.step()
    assert torch.allclose(policy.params[0].detach(), reference.detach(), atol=1e-12)
    alone = LabPolicy(prior[:1], replace(TINY, optimizer="adam", lr=0.05))
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        alone.params[0].grad = torch.randn(prior.shape, generator=generator, dtype=torch.float64)[:1]
        alone.step(torch.ones(1, dtype=torch.float64))
    assert torch.allclose(alone.params[0].detach(), policy.params[0].detach()[:1], atol=1e-12)


def test_first_order_term_matches_the_exact_entropy_change_for_a_tiny_step():
    """-Cov_pi(log pi, dz) is the entropy's derivative along dz: for a tiny step the remainder is
    second order (shrinks 100x for a 10x smaller step), for a large one it is not negligible."""
    generator = torch.Generator().manual_seed(4)
    before = 2.0 * torch.randn(2, 3, 4, 8, generator=generator, dtype=torch.float64)
    direction = torch.randn(before.shape, generator=generator, dtype=torch.float64)
    prompt = torch.tensor([[0, 1, 2, 2], [1, 1, 0, 2]])
    mask = torch.ones(2, 4, 4, dtype=torch.bool)

    def split(logits_before, logits_after):  # as run_cell's update calls it
        log_pi = torch.log_softmax(logits_before, -1)
        entropy = -(log_pi.exp() * log_pi).sum(-1)
        entropy_after = state_entropy(logits_after)
        return entropy_split(log_pi, entropy, entropy_after, logits_after - logits_before, prompt, mask)

    remainders = []
    for eps in (1e-3, 1e-4):
        first, change = split(before, before + eps * direction)
        assert torch.allclose(first, change, rtol=1e-2)
        remainders.append((change - first).abs())
    assert torch.all(remainders[1] < remainders[0] / 50)
    first, change = split(before, before + 3.0 * direction)
    assert ((change - first).abs() > 0.05 * change.abs()).any()


def test_a_run_records_the_split_and_the_premise_at_every_update():
    """premise=True: entropy/first_order + entropy/remainder == entropy/batch_change at every
    update, and the premise shares per update (NaN where nothing was clipped); the default
    LabConfig records neither (the default lab's rows are unchanged)."""
    cfg = Regime(filler=1).config(TINY)
    run = run_cell(Cell("grpo", 2), cfg)
    u = run.updates
    assert torch.allclose(u["entropy/first_order"] + u["entropy/remainder"], u["entropy/batch_change"])
    assert u["premise/pos_kept_low_share"].shape == (2, 9)
    assert u["premise/pos_kept_low_share"].isfinite().any()
    share = u["premise/pos_clipped_low_share"]
    assert share[share.isfinite()].ge(0).all() and share[share.isfinite()].le(1).all()
    assert {"exact/entropy/guess", "exact/entropy/filler"} <= u.keys()
    plain = run_cell(Cell("grpo", 2), TINY).updates
    assert not any(key.startswith("premise/") or key.startswith("exact/entropy/") for key in plain)
    assert "entropy/first_order" not in plain


def test_sgd_step_scales_with_filler_adam_does_not():
    assert replace(TINY, task=replace(TINY.task, filler=3), lr=10.0).step_size == 40.0
    assert replace(TINY, task=replace(TINY.task, filler=3), lr=0.1, optimizer="adam").step_size == 0.1


def test_stage_apart_methods_are_grpo_with_bapos_maximum_bounds():
    """Each stage variant is the grpo loss at fixed bounds: c_high at BAPO's upper_max, c_low at
    its lower_max, or both; the bounds used at every update are those; not in the default plan."""
    search = BAPOConfig()
    assert method_loss(STAGE_C_HIGH) == ("grpo", {"upper": search.upper_max})
    assert method_loss(STAGE_C_LOW) == ("grpo", {"lower": search.lower_max})
    assert method_loss(STAGE_BOTH) == ("grpo", {"lower": search.lower_max, "upper": search.upper_max})
    grpo = method_loss("grpo")
    assert grpo == ("grpo", {})
    for method, (lower, upper) in (
        (STAGE_C_HIGH, (0.8, search.upper_max)),
        (STAGE_C_LOW, (search.lower_max, 1.2)),
        (STAGE_BOTH, (search.lower_max, search.upper_max)),
    ):
        u = run_cell(Cell(method, 2), TINY).updates
        assert torch.allclose(u["lower"], torch.full_like(u["lower"], lower))
        assert torch.allclose(u["upper"], torch.full_like(u["upper"], upper))
        assert method not in METHODS
    # at E = 0 nothing clips (ratio 1), so each stage variant runs GRPO's updates exactly
    same = run_cell(Cell(STAGE_BOTH, 0), TINY).updates["exact/entropy"]
    assert torch.equal(same, run_cell(Cell("grpo", 0), TINY).updates["exact/entropy"])


def test_full_batch_epochs_train_every_row_at_every_update():
    """split="epochs": E + 1 updates per batch, each on the whole batch (its batch reward is the
    same at each); the mini-batch split trains a different part at each."""
    epochs = run_cell(Cell("grpo", 2), replace(TINY, split="epochs"))
    reward = epochs.updates["reward/batch"].reshape(2, 3, 3)
    assert torch.equal(reward, reward[:, :, :1].expand_as(reward))
    assert replace(TINY, split="epochs").train_config(Cell("grpo", 2)).offpolicy.epochs == 3
    split = run_cell(Cell("grpo", 2), TINY).updates["reward/batch"].reshape(2, 3, 3)
    assert not torch.equal(split, split[:, :, :1].expand_as(split))


def test_bad_regime_fields_fail_with_the_field():
    for field, value in (("optimizer", "rmsprop"), ("parameters", "mlp"), ("split", "halves")):
        with pytest.raises(ValueError, match=field):
            replace(TINY, **{field: value})
    with pytest.raises(ValueError, match="filler"):
        GuessTask(filler=-1)


def test_regimes_run_every_cell_and_report_the_claims(tmp_path):
    """run_regimes writes every regime's claims (1, 4, the stages, the premise, the split) and the
    tables of regimes.md; nothing is left out for its outcome."""
    regimes = [Regime(), Regime(filler=1, prior_scale=6.0, optimizer="adam", parameters="shared")]
    base = replace(TINY, seeds=3)
    claims, out = run_regimes(tmp_path, regimes=regimes, jobs=1, base=base)
    assert list(claims) == [r.name for r in regimes]
    for found in claims.values():
        ids = {claim.id for claim in found}
        assert {"4-entropy-E=4", "2-c_high-E4", "2-c_low-E4-reward", "F-first-order-E4", "F-remainder-E4"} <= ids
    text = (out / "regimes.md").read_text()
    for section in ("Claims 1 and 4", "stages apart", "The premise", "First-order vs remainder", "by axis"):
        assert section in text
    rows = (out / "cells" / "k1_prior6_adam_shared_mini-batches" / "bapo_E=4" / "metrics.jsonl").read_text()
    first = json.loads(rows.splitlines()[0])  # the premise and the split, per update, per regime
    assert {"premise/pos_clipped_low_share", "entropy/first_order", "entropy/remainder"} <= first.keys()
    assert len(rows.splitlines()) == 3 * 3 * 5  # seeds x rollout steps x (E + 1)
    summary = json.loads((out / "regimes.json").read_text())
    assert len(summary[regimes[1].name]["entropy_parts"]) == len(REGIME_CELLS)
    assert summary[regimes[1].name]["entropy_parts"][0]["filler, end"] != "-"


def test_regime_claims_come_from_the_runs():
    """A changed run changes its claim: BAPO's first-order sum made larger raises F-first-order."""
    cfg = Regime().config(replace(TINY, seeds=3))
    runs = [run_cell(cell, cfg) for cell in REGIME_CELLS]
    before = {c.id: c.effect for c in regime_claims(runs, cfg.rollout_steps)}
    runs[2].updates["entropy/first_order"] = runs[2].updates["entropy/first_order"] + 1.0
    after = {c.id: c.effect for c in regime_claims(runs, cfg.rollout_steps)}
    updates = runs[2].updates["entropy/first_order"].shape[1]
    assert after["F-first-order-E4"] == pytest.approx(before["F-first-order-E4"] + updates, abs=1e-6)


def test_bapo_lab_regimes_cli(tmp_path, monkeypatch):
    """`bapo lab --regimes --quick --json` runs the quick map (made one tiny regime here) and prints
    regimes.json; --regimes refuses --peers and one seed with the flag named."""
    from typer.testing import CliRunner

    from bapo.cli.main import app
    from bapo.lab import regimes as regime_lab

    tiny = replace(TINY, seeds=2)
    monkeypatch.setattr(regime_lab, "plan_regimes", lambda quick, seeds: ([Regime(filler=1)], tiny))
    result = CliRunner().invoke(app, ["lab", "--regimes", "--quick", "--json", "--jobs", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.output)) == [Regime(filler=1).name]
    assert CliRunner().invoke(app, ["lab", "--regimes", "--peers"]).exit_code != 0
    monkeypatch.undo()
    refused = CliRunner().invoke(app, ["lab", "--regimes", "--seeds", "1"])
    assert refused.exit_code != 0 and "seeds" in refused.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--regimes", "--async-delays"], "choose one"),
        (["--regimes", "--peers"], "choose one"),
        (["--peers", "--async-delays"], "choose one"),
        (["--choose-lr"], "goes with --regimes"),
        (["--regimes", "--choose-lr", "--quick"], "drop --quick"),
        (["--regimes", "--choose-lr", "--seeds", "1"], "gives no interval"),
    ],
)
def test_lab_refuses_flags_that_do_not_go_together_in_one_line(args, message):
    from typer.testing import CliRunner

    from bapo.cli.main import app

    result = CliRunner().invoke(app, ["lab", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
