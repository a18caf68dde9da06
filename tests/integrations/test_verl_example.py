"""examples/verl composes into verl's config; verl loads bapo in its workers; the worker hook installs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

pytestmark = pytest.mark.verl  # runs in .venv-verl (make test)


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl"
PYTHON_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def launch_arguments(**env: str) -> list[str]:
    """The verl command run_bapo.sh would run (DRY_RUN), one argument per element."""
    printed = subprocess.run(
        ["bash", str(EXAMPLE / "run_bapo.sh"), "trainer.total_epochs=1"],
        env={**os.environ, "DRY_RUN": "1", "MODEL_PATH": "/models/m", "TRAIN_FILES": "/data/train.parquet", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return printed.stdout.splitlines()


def compose(arguments: list[str]):
    """verl's Hydra config as main_ppo would see it for these command-line arguments."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = next(a.split("=", 1)[1] for a in arguments if a.startswith("--config-path="))
    config_name = next(a.split("=", 1)[1] for a in arguments if a.startswith("--config-name="))
    overrides = [a for a in arguments[3:] if not a.startswith("--")]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name=config_name, overrides=overrides)


def test_example_config_is_the_papers_setting():
    from verl.utils.config import omega_conf_to_dataclass

    from bapo.core import BAPOConfig
    from bapo.integrations.verl import BAPOPolicyLossConfig

    config = compose(launch_arguments(STALENESS="3"))
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor_rollout_ref.rollout.n == 16
    updates = config.data.train_batch_size // config.actor_rollout_ref.actor.ppo_mini_batch_size
    assert updates * config.actor_rollout_ref.actor.ppo_epochs == 4  # E = 3: data 0..3 updates old

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # what ActorRolloutRefWorker builds
    policy_loss = actor.policy_loss
    assert isinstance(policy_loss, BAPOPolicyLossConfig) and policy_loss.loss_mode == "bapo"
    search = policy_loss.bapo_config()
    assert (search.target, search.target_kind, search.order) == (0.4, "share", "upper-first")
    assert (search.lower_grid[0], search.lower_grid[-1]) == pytest.approx((0.6, 0.9))
    assert (search.upper_grid[0], search.upper_grid[-1]) == pytest.approx((1.2, 3.0))
    assert (search.lower_step, search.upper_step) == (0.02, 0.05)
    assert actor.optim.lr == 2e-6 and config.actor_rollout_ref.rollout.temperature == 0.6
    assert actor.clip_ratio_c == 3.0  # dual-clip, read by bapo's loss as verl's vanilla reads it
    # the paper's grid and order with bapo's gradient share (the file names the Eq. 8 switch)
    assert search == BAPOConfig.paper(contribution="gradient", weighting="none")


def test_recipe_config_is_the_recipes_search():
    from verl.utils.config import omega_conf_to_dataclass

    from bapo.core import BAPOConfig

    config = compose(launch_arguments(CONFIG="bapo_recipe"))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    search = actor.policy_loss.bapo_config()
    assert search == BAPOConfig.recipe()  # the recipe exactly: clamped pos/neg, its stepping and eps
    assert (search.target, search.target_kind, search.order) == (1.0, "pos_neg", "lower-first")
    assert (search.lower_grid[0], search.lower_grid[-1]) == pytest.approx((0.6, 0.8))
    assert (search.upper_grid[0], search.upper_grid[-1]) == pytest.approx((1.2, 2.0))
    assert (search.lower_step, search.upper_step) == (0.05, 0.05) and actor.clip_ratio_c == 3.0
    assert actor.optim.lr == 2e-6 and config.actor_rollout_ref.rollout.n == 16  # the rest from bapo_common.yaml


def test_staleness_sets_the_mini_batch_size():
    config = compose(launch_arguments(STALENESS="1", TRAIN_PROMPTS="128"))
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 64


def test_import_verl_loads_bapo_through_the_verl_plugins_entry_point(tmp_path):
    """verl loads every `verl.plugins` entry point at `import verl`, so each Ray worker registers
    bapo's losses. The distribution here declares only the entry point bapo's pyproject declares."""
    dist_info = tmp_path / "bapo_entry_point_probe-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: bapo-entry-point-probe\nVersion: 0\n")
    import tomllib

    declared = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    entry_point = declared["project"]["entry-points"]["verl.plugins"]["bapo"]
    (dist_info / "entry_points.txt").write_text(f"[verl.plugins]\nbapo = {entry_point}\n")
    probe = (
        "import sys, verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as r; "
        "from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode as bypass; "
        "print('bapo.integrations.verl' in sys.modules, sorted(k for k in ('bapo', 'topr', 'dcpo') if k in r), "
        "getattr(bypass, 'bapo_guard', False))"
    )
    env = {**PYTHON_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "VERL_USE_EXTERNAL_PLUGINS": "bapo"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "True ['bapo', 'dcpo', 'topr'] True", done.stderr[-2000:]


def test_a_plugin_that_fails_to_load_says_so_at_error_level(monkeypatch, caplog):
    """verl logs a failing plugin at DEBUG (invisible); bapo's entry point logs it at ERROR first."""
    import importlib

    monkeypatch.setitem(sys.modules, "bapo.integrations.verl", None)  # any import of it now fails
    monkeypatch.delitem(sys.modules, "bapo.integrations.verl_plugin", raising=False)
    with caplog.at_level("ERROR", logger="bapo"), pytest.raises(ImportError):
        importlib.import_module("bapo.integrations.verl_plugin")
    assert "bapo's verl plugin failed to load (ModuleNotFoundError" in caplog.text and "not registered" in caplog.text


def test_bypass_mode_with_a_bapo_loss_fails_in_one_line_and_leaves_other_losses_alone():
    """verl's bypass mode rewrites policy_loss.loss_mode to 'bypass_mode' (PPO-clip): refused for bapo's losses."""
    import torch
    from omegaconf import OmegaConf
    from verl.trainer.ppo import rollout_corr_helper

    from bapo.integrations.verl.plugin import guard_bypass_mode

    guard_bypass_mode()
    guard_bypass_mode()  # idempotent: one wrapper
    assert not getattr(rollout_corr_helper.apply_bypass_mode.__wrapped__, "bapo_guard", False)

    class Batch:
        batch = {"rollout_log_probs": torch.zeros(1, 2)}

    bapo_loss = OmegaConf.create({"loss_mode": "bapo"})
    with pytest.raises(ValueError, match=r"bypass_mode=True would replace .*loss_mode=bapo .*bypass_mode=False"):
        rollout_corr_helper.apply_bypass_mode(Batch(), rollout_corr_config=None, policy_loss_config=bapo_loss)
    assert bapo_loss.loss_mode == "bapo"
    vanilla = OmegaConf.create({"loss_mode": "vanilla"})
    rollout_corr_helper.apply_bypass_mode(Batch(), rollout_corr_config=None, policy_loss_config=vanilla)
    assert vanilla.loss_mode == "bypass_mode"  # verl's own behaviour, untouched


def test_the_plugin_hook_installs_the_worker_and_the_config_does_not(monkeypatch):
    """Runtime wiring lives in the plugin entry point (install_worker_hook), not in building the config."""
    pytest.importorskip("verl.workers.engine_workers")
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from bapo.integrations.verl import BAPOPolicyLossConfig
    from bapo.integrations.verl.plugin import install_worker_hook
    from bapo.integrations.verl.worker import BAPOTrainingWorker

    monkeypatch.setattr(ActorRolloutRefWorker, "actor_worker_cls", TrainingWorker)
    BAPOPolicyLossConfig(loss_mode="bapo")
    assert ActorRolloutRefWorker.actor_worker_cls is TrainingWorker
    install_worker_hook()  # verl's worker module is loaded here: installs at once
    assert ActorRolloutRefWorker.actor_worker_cls is BAPOTrainingWorker


@pytest.mark.parametrize(
    ("name", "primary"), [("bapo_common", "bapo_grpo"), ("bapo_grpo", "bapo_grpo"), ("bapo_recipe", "bapo_recipe")]
)
def test_example_sets_only_keys_verl_has_or_bapo_adds(name, primary):
    """A typo in an example yaml would merge silently into verl's config: compare with verl's own."""
    from dataclasses import fields

    from omegaconf import OmegaConf
    from verl.workers.config import PolicyLossConfig

    from bapo.integrations.verl import BAPOPolicyLossConfig

    def leaves(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            yield from leaves(value, path + ".") if isinstance(value, dict) else [path]

    ours = OmegaConf.to_container(OmegaConf.load(EXAMPLE / f"{name}.yaml"))
    ours = {k: v for k, v in ours.items() if k not in ("hydra", "defaults")}
    verl = compose(["python3", "-m", "main", f"--config-path={EXAMPLE}", f"--config-name={primary}"])
    base = compose(["python3", "-m", "main", f"--config-path={verl_config_dir()}", "--config-name=ppo_trainer"])
    added = {f"actor_rollout_ref.actor.policy_loss.{f.name}" for f in fields(BAPOPolicyLossConfig)} - {
        f"actor_rollout_ref.actor.policy_loss.{f.name}" for f in fields(PolicyLossConfig)
    }
    for path in leaves(ours):
        assert OmegaConf.select(verl, path) is not None, path
        assert path in added or OmegaConf.select(base, path, default="<absent>") != "<absent>", path


def verl_config_dir() -> str:
    import verl.trainer.config

    return str(Path(verl.trainer.config.__file__).parent)


def test_verl_modules_import_no_circle_and_the_config_nothing_of_the_worker():
    """config (the dataclass) <- losses <- plugin, worker: imports read with ast, function-level ones included."""
    from tests.test_layering import PACKAGE, imports_of, module_name

    folder = PACKAGE / "integrations" / "verl"
    graph = {
        module_name(path): {imp.module for imp in imports_of(path) if imp.module.startswith("bapo.integrations.verl.")}
        for path in folder.glob("*.py")
        if path.name != "__init__.py"
    }
    assert graph["bapo.integrations.verl.config"] == set()

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(
            name == target or (name not in seen and reaches(name, target, seen | {name}))
            for name in graph.get(start, ())
        )

    circles = [name for name in graph if reaches(name, name, set())]
    assert circles == [], f"import circle through {circles}"
