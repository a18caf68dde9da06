import pytest

from bapo.train import ConfigError, Trainer, load_config
from tests.helpers import arithmetic_examples, make_config


def test_example_config_loads_and_overrides_apply():
    cfg = load_config("examples/configs/bapo_math.yaml", ["loss.method=grpo", "offpolicy.staleness=0",
                                                          'rollout.stop=["\\n"]', "optim.lr=3e-6"])
    assert cfg.loss.method == "grpo" and cfg.offpolicy.staleness == 0
    assert cfg.rollout.stop == ["\n"] and cfg.optim.lr == 3e-6


@pytest.mark.parametrize("override, expected", [
    ("rollout.grup_size=2", "did you mean 'rollout.group_size'"),
    ("rolout.group_size=2", "did you mean 'rollout'"),
    ("loss.bapo.targte=0.5", "did you mean 'loss.bapo.target'"),
])
def test_unknown_key_names_the_nearest_valid_one(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("examples/configs/bapo_math.yaml", [override])


@pytest.mark.parametrize("override, expected", [
    ("rollout.temperature=-1", "rollout.temperature"),
    ("loss.method=bappo", "did you mean 'bapo'"),
    ("loss.agg_mode=token_mean", "did you mean 'token-mean'"),
    ("offpolicy.mini_batches=3", "offpolicy.mini_batches=3 must divide"),
    ("loss.bapo.lower_max=1.5", "loss.bapo.lower_start/lower_max"),
    ("loss.params={uper: 2}", "loss.params.uper"),
    ("rollout.group_size=1", "rollout.group_size=1"),
    ("model.dtype=fp8", "model.dtype"),
    ("data.path=train.csv", "data.path"),
])
def test_bad_value_names_the_field(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("examples/configs/bapo_math.yaml", [override])


def test_override_needs_key_value():
    with pytest.raises(ConfigError, match="key=value"):
        load_config("examples/configs/bapo_math.yaml", ["loss.method"])


def test_bad_setup_fails_before_model_loading(tmp_path):
    """A missing model path would raise OSError from from_pretrained; these must fail first."""
    cfg = make_config(str(tmp_path / "no-such-model"), tmp_path / "run", **{"reward.verifier": "nope"})
    with pytest.raises(ConfigError, match="reward.verifier='nope'"):
        Trainer(cfg, examples=arithmetic_examples())
    cfg = make_config(str(tmp_path / "no-such-model"), tmp_path / "run", **{"reward.verifier": "no_mod:fn"})
    with pytest.raises(ConfigError, match="cannot be imported"):
        Trainer(cfg, examples=arithmetic_examples())
    cfg = make_config(str(tmp_path / "no-such-model"), tmp_path / "run", **{"data.path": str(tmp_path / "x.jsonl")})
    with pytest.raises(ConfigError, match="file not found"):
        Trainer(cfg)
    cfg = make_config(str(tmp_path / "no-such-model"), tmp_path / "run", **{"data.answer_key": "solution"})
    with pytest.raises(ConfigError, match="data.answer_key='solution'"):
        Trainer(cfg, examples=arithmetic_examples())
    cfg = make_config(str(tmp_path / "no-such-model"), tmp_path / "run", **{"rollout.backend": "vllm"})
    with pytest.raises(ConfigError, match="rollout.backend=vllm"):
        Trainer(cfg, examples=arithmetic_examples())
