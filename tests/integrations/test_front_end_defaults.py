"""One BAPO configuration across the front ends: presets by name, the generated fields, dual-clip."""

import pytest

pytest.importorskip("trl")
pytest.importorskip("verl")

from verl.workers.config import ActorConfig  # noqa: E402

from bapo.core import BAPOConfig  # noqa: E402
from bapo.integrations.trl import BAPOGRPOConfig  # noqa: E402
from bapo.integrations.verl import BAPOPolicyLossConfig  # noqa: E402
from bapo.integrations.verl.losses import _core_params  # noqa: E402
from bapo.train.update import loss_params  # noqa: E402
from tests.helpers import make_config  # noqa: E402

pytestmark = pytest.mark.verl  # runs in .venv-verl (make test)


def trl_args(tmp_path, **fields) -> BAPOGRPOConfig:
    return BAPOGRPOConfig(str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", **fields)


def verl_params(policy_loss: BAPOPolicyLossConfig, method: str = "bapo") -> dict:
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1, policy_loss=policy_loss
    )
    return _core_params(method, config)


def test_method_bapo_has_one_dual_clip_default_in_every_front_end(tmp_path):
    train_cfg = make_config("unused", str(tmp_path / "run"), **{"loss.method": "bapo"})
    caps = {
        "bapo train": loss_params(train_cfg)["dual_clip"],
        "TRL": trl_args(tmp_path).bapo_loss_params()["dual_clip"],
        "verl": verl_params(BAPOPolicyLossConfig(loss_mode="bapo"))["dual_clip"],
    }
    assert caps == {"bapo train": 3.0, "TRL": 3.0, "verl": 3.0}
    # TRL's fixed-bound methods keep TRL's own GRPO surrogate (no dual-clip); an explicit cap wins
    assert "dual_clip" not in trl_args(tmp_path, bapo_method="grpo").bapo_loss_params()
    assert trl_args(tmp_path, bapo_dual_clip=2.0).bapo_loss_params()["dual_clip"] == 2.0


@pytest.mark.parametrize("preset", ["default", "paper", "recipe"])
def test_presets_are_selectable_by_name_in_trl_and_verl(tmp_path, preset):
    expected = BAPOConfig.preset(preset, scope="micro_batch")
    assert trl_args(tmp_path, bapo_preset=preset, bapo_scope="micro_batch").bapo_config() == expected
    assert BAPOPolicyLossConfig(preset=preset, scope="micro_batch").bapo_config() == expected


def test_trl_fields_are_generated_from_bapo_config_and_keep_their_names(tmp_path):
    from dataclasses import fields

    trl_fields = {spec.name: spec for spec in fields(BAPOGRPOConfig)}
    for spec in fields(BAPOConfig):
        generated = trl_fields[f"bapo_{spec.name}"]
        assert spec.metadata["help"] in generated.metadata["help"], spec.name
    args = trl_args(tmp_path, bapo_target=0.55, bapo_upper_max=2.0, bapo_order="lower-first")  # earlier names
    assert args.bapo_config() == BAPOConfig(target=0.55, upper_max=2.0, order="lower-first")


def test_unknown_names_fail_in_one_line_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="^preset: 'papr' is not one of"):
        trl_args(tmp_path, bapo_preset="papr")
    with pytest.raises(ValueError, match="^bapo_method_kwargs: upper: not a parameter of the 'bapo' loss"):
        trl_args(tmp_path, bapo_method_kwargs={"upper": 1.3})
    with pytest.raises(ValueError, match="^preset: 'papr' is not one of"):
        BAPOPolicyLossConfig(preset="papr")
    with pytest.raises(TypeError, match="bapo_targte"):  # a misspelt TRL field is Python's own error
        trl_args(tmp_path, bapo_targte=0.5)
