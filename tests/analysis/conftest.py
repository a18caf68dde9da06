import pytest


@pytest.fixture(autouse=True)
def _one_thread_and_private_cache(monkeypatch, tmp_path):
    """Tests share the CPU: one torch thread; a warm start never lands in the user's cache."""
    import torch

    torch.set_num_threads(1)
    monkeypatch.setenv("BAPO_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A random-init 1-layer model + the demo tokenizer, saved like the warm start is."""
    from bapo.train.tiny import ModelConfig, save_tiny_model

    return save_tiny_model(tmp_path / "tiny", ModelConfig(hidden_size=32, layers=1, heads=2, intermediate_size=64))


@pytest.fixture
def heldout_file(tmp_path):
    from bapo.experiments.task import TaskConfig, make_split
    from bapo.train.data import write_jsonl

    _, heldout = make_split(TaskConfig(n_train=10, n_heldout=6))
    return write_jsonl(heldout, tmp_path / "heldout.jsonl")
