"""The adaptive BAPO target inside BAPOGRPOTrainer: fed each optimizer step's entropy, logged."""

import math

import pytest

pytest.importorskip("trl")

from bapo.core import EntropyTargetController
from tests.integrations.test_trl_trainer import make_trainer, tiny_model_dir  # noqa: F401


def test_entropy_target_moves_after_the_hold_and_is_logged(tiny_model_dir, tmp_path):  # noqa: F811
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        max_steps=4,
        num_iterations=2,
        bapo_target=0.6,
        bapo_target_mode="entropy",
        bapo_target_hold_updates=1,
        bapo_target_gain=5.0,
        bapo_target_min=0.1,
        bapo_target_max=0.9,
    )
    trainer.train()
    targets = [entry["bapo/target"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(targets) == 4 and targets[:2] == [0.6, 0.6]  # step 1: no entropy yet; step 2: set point taken
    assert all(0.1 <= t <= 0.9 and math.isfinite(t) for t in targets) and targets[2:] != [0.6, 0.6]
    assert trainer.bapo_step.controller.set_point > 0


def test_controller_state_is_in_the_checkpoint(tiny_model_dir, tmp_path):  # noqa: F811
    options = {
        "num_iterations": 2,
        "bapo_target": 0.6,
        "bapo_target_mode": "entropy",
        "bapo_target_hold_updates": 1,
        "bapo_target_min": 0.1,
        "bapo_target_max": 0.9,
    }
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=3, save_strategy="steps", save_steps=3, **options)
    trainer.train()
    saved = trainer.bapo_step.state_dict()
    assert saved["controller"]["set_point"] is not None
    assert (tmp_path / "out" / "checkpoint-3" / "bapo_step_rank0.json").exists()
    resumed = make_trainer(tiny_model_dir, tmp_path, max_steps=3, **options)
    resumed._load_from_checkpoint(str(tmp_path / "out" / "checkpoint-3"))
    assert resumed.bapo_step.state_dict() == saved


def test_resume_without_controller_state_warns_and_starts_afresh(tiny_model_dir, tmp_path):  # noqa: F811
    """The one missing-state behaviour of every front end (bapo.core.BAPOStep.load_state_dict)."""
    from bapo.core import MissingStepStateWarning

    options = {"num_iterations": 2, "bapo_target": 0.6, "bapo_target_mode": "entropy", "bapo_target_hold_updates": 1}
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=2, **options)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    (checkpoint / "bapo_step_rank0.json").unlink()
    resumed = make_trainer(tiny_model_dir, tmp_path, max_steps=2, **options)
    with pytest.warns(MissingStepStateWarning, match=f"{checkpoint}.*no entropy-controller state"):
        resumed._load_from_checkpoint(str(checkpoint))
    assert resumed.bapo_step.controller.state_dict() == EntropyTargetController(resumed.args.bapo_config()).state_dict()
    assert trainer.bapo_step.controller.set_point is not None  # the saved run had moved on
