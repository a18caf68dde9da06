import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.train import ConfigError, Trainer, load_config
from tests.helpers import arithmetic_examples, make_config


def test_example_config_loads_and_overrides_apply():
    cfg = load_config(
        "examples/configs/bapo_math.yaml",
        ["loss.method=grpo", "offpolicy.async_delay=0", 'rollout.stop=["\\n"]', "optim.lr=3e-6"],
    )
    assert cfg.loss.method == "grpo" and cfg.offpolicy.async_delay == 0
    assert cfg.rollout.stop == ["\n"] and cfg.optim.lr == 3e-6


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.grup_size=2", "did you mean 'rollout.group_size'"),
        ("rolout.group_size=2", "did you mean 'rollout'"),
        ("loss.bapo.targte=0.5", "did you mean 'loss.bapo.target'"),
    ],
)
def test_unknown_key_names_the_nearest_valid_one(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("examples/configs/bapo_math.yaml", [override])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.temperature=-1", "rollout.temperature"),
        ("loss.method=bappo", "did you mean 'bapo'"),
        ("loss.agg_mode=token_mean", "did you mean 'token-mean'"),
        ("offpolicy.mini_batches=17", "offpolicy.mini_batches=17 is more than the 16 prompt groups"),
        ("loss.bapo.lower_max=1.5", "loss.bapo.lower_start/lower_max"),
        ("loss.params={uper: 2}", "loss.params.uper"),
        ("rollout.group_size=1", "rollout.group_size=1"),
        ("model.dtype=fp8", "model.dtype"),
        ("data.path=train.csv", "data.path"),
    ],
)
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
    with pytest.raises(ConfigError, match=r"examples row 1: no key 'solution' \(data.answer_key\)"):
        Trainer(cfg, examples=arithmetic_examples())
    cfg = make_config(str(tmp_path / "no-such-model"), tmp_path / "run")
    with pytest.raises(ConfigError, match="model.path=.*no such folder"):
        Trainer(cfg, examples=arithmetic_examples())


def test_vllm_backend_and_its_correction_are_checked_without_vllm():
    cfg = load_config("examples/configs/bapo_math.yaml", ["rollout.backend=vllm", "rollout.correction=tis"])
    assert (cfg.rollout.backend, cfg.rollout.correction, cfg.rollout.correction_level) == ("vllm", "tis", "token")
    with pytest.raises(ConfigError, match=r"rollout.correction=tis: .*rollout.backend=vllm"):
        load_config("examples/configs/bapo_math.yaml", ["rollout.correction=tis"])
    with pytest.raises(ConfigError, match=r"rollout.correction_lower=3.0 must be below rollout.correction_cap=2.0"):
        load_config(
            "examples/configs/bapo_math.yaml",
            ["rollout.backend=vllm", "rollout.correction=mis", "rollout.correction_lower=3"],
        )


@pytest.mark.parametrize(
    "override, field, expected",
    [
        ("run.tensorboard=off", ("run", "tensorboard"), "off"),  # YAML 1.1 would give False
        ("run.tensorboard=on", ("run", "tensorboard"), "on"),
        ("data.system_prompt=Answer: 42", ("data", "system_prompt"), "Answer: 42"),  # YAML: a mapping
        ("data.system_prompt=null", ("data", "system_prompt"), None),
        ("data.prompt_key=0", ("data", "prompt_key"), "0"),
        ("reward.verifier=yes", ("reward", "verifier"), "yes"),
        ("run.progress=off", ("run", "progress"), False),  # a bool field still takes off/on
        ("optim.lr=3.0e-6", ("optim", "lr"), 3e-6),
        ("optim.max_grad_norm=null", ("optim", "max_grad_norm"), None),
    ],
)
def test_an_override_stays_a_string_where_the_field_takes_one(override, field, expected):
    cfg = load_config("examples/configs/bapo_math.yaml", [override])
    assert getattr(getattr(cfg, field[0]), field[1]) == expected


@given(
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40).filter(
        lambda t: t.strip() == t and t not in ("null", "Null", "NULL", "~")
    )
)
@settings(max_examples=60, deadline=None)
def test_any_text_override_of_a_string_field_arrives_unchanged(text):
    from bapo.train import config_from_dict

    cfg = config_from_dict({"model": {"path": "m"}}, [f"data.system_prompt={text}"])
    # YAML quotes are the one way to write a string that needs them; anything else is taken verbatim
    if not (len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""):
        assert cfg.data.system_prompt == text


def test_yaml_file_off_is_a_string_and_errors_name_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: m\nrun:\n  tensorboard: off\nrollout:\n  group_size: 4\n  temperature: -1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "rollout.temperature" in message and f"{path} line 7" in message and "\n" not in message
    path.write_text("model:\n  path: m\nrun:\n  tensorboard: off\n")
    assert load_config(path).run.tensorboard == "off"
    path.write_text("model:\n  path: m\nrollout:\n  grup_size: 2\n")
    with pytest.raises(ConfigError, match=f"did you mean 'rollout.group_size'.*{path} line 4"):
        load_config(path)
    path.write_text("model:\n  path: m\n rollout: [\n")
    with pytest.raises(ConfigError, match=f"{path} line [23]: not valid YAML"):
        load_config(path)


def test_missing_model_path_says_how_to_set_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  path: x.jsonl\n")
    with pytest.raises(ConfigError, match=f"model.path is not set in {path}: give a local model folder"):
        load_config(path)


def test_print_config_lists_every_key_with_default_and_description():
    from pydantic import BaseModel

    from bapo.train.config import TrainConfig
    from bapo.train.config_io import describe_config

    text = describe_config("examples/configs/bapo_math.yaml", ["run.tensorboard=off"])

    def keys(model, indent=""):
        for name, info in model.model_fields.items():
            yield indent + name + ":"
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                yield from keys(info.annotation, indent + "  ")

    lines = text.splitlines()
    for key in keys(TrainConfig):
        assert any(line.startswith(key) for line in lines), key
    leaves = [line for line in lines if line.split("#")[0].strip().split(":", 1)[1].strip()]
    assert all("# " in line and ("(default " in line or "(required)" in line) for line in leaves)
    assert "  tensorboard: 'off'" in text and "(default auto)" in text and "  method: bapo" in text
    bare = describe_config(None, [])  # no file, no model.path: still prints, path shown as null
    assert "  path: null" in bare


def test_bapo_presets_by_name_with_overrides_and_the_flat_keys_still_work(tmp_path):
    from bapo.core import BAPOConfig

    def bapo_config(**keys):
        sections = {"loss.method": "bapo", **{f"loss.bapo.{name}": value for name, value in keys.items()}}
        return make_config("unused", str(tmp_path / "run"), **sections).loss.bapo_config()

    assert bapo_config(preset="paper") == BAPOConfig.paper()
    assert bapo_config(preset="recipe", target=1.5) == BAPOConfig.recipe(target=1.5)
    assert bapo_config(target=0.5) == BAPOConfig(target=0.5)  # the keys of earlier configs
    with pytest.raises(ConfigError, match="loss.bapo.preset"):
        load_config("examples/configs/bapo_math.yaml", ["loss.bapo.preset=papr"])


def test_print_config_describes_every_bapo_key_with_bapo_configs_own_help():
    from dataclasses import fields

    from bapo.core import BAPOConfig
    from bapo.train.config_io import describe_config

    lines = {line.split(":")[0].strip(): line for line in describe_config(None, []).splitlines()}
    for spec in fields(BAPOConfig):
        assert f"# {spec.metadata['help']} (default " in lines[spec.name], spec.name
