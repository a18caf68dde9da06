import pytest


@pytest.fixture(autouse=True)
def _one_thread_and_private_cache(monkeypatch, tmp_path):
    """Tests share the CPU: one torch thread; a warm start never lands in the user's cache."""
    import torch

    torch.set_num_threads(1)
    monkeypatch.setenv("BAPO_CACHE", str(tmp_path / "cache"))
