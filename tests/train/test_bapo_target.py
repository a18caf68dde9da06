"""The adaptive BAPO target in the trainer: logged every update, and resumed exactly."""

from bapo.train import read_metrics, train
from tests.helpers import arithmetic_examples, digit_share, make_config
from tests.train.test_resume import check_resume_is_exact

ENTROPY_TARGET = {
    "offpolicy.async_delay": 1,
    "loss.method": "bapo",
    "optim.micro_batch_size": 6,
    "loss.bapo.target_mode": "entropy",
    "loss.bapo.target_hold_updates": 2,
    "loss.bapo.target_gain": 5.0,
    "loss.bapo.target_min": 0.05,
    "loss.bapo.target_max": 0.95,
    "loss.bapo.target": 0.4,
}


def test_resume_is_exact_with_the_entropy_controller(tiny_model, tmp_path):
    """3 steps + resume + 3 equals 6 straight, controller state (set point, integral) included."""
    check_resume_is_exact(tiny_model, tmp_path, ENTROPY_TARGET)


def test_target_is_logged_every_update_and_moves_after_the_hold(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 6, **ENTROPY_TARGET})
    rows = read_metrics(train(cfg, examples=arithmetic_examples(), verifier=digit_share))
    targets = [row["bapo/target"] for row in rows]
    assert len(targets) == 6 and targets[:3] == [0.4] * 3  # held: 2 updates measured, applied from the 3rd on
    assert len(set(targets[3:])) > 1 or targets[3] != 0.4
    assert all(0.05 <= t <= 0.95 for t in targets)
