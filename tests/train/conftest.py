"""Fixtures of the trainer tests; the plain helpers they use live in tests/helpers.py."""

from __future__ import annotations

import pytest

from tests.helpers import build_tiny_model


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from more threads, and on a shared CPU oversubscribed OpenMP
    threads make these tests ~10x slower; restored afterwards for other test directories."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    build_tiny_model(path)
    return str(path)
