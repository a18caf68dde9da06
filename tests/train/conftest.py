"""Fixtures of the trainer tests; the plain helpers they use live in tests/helpers.py."""

from __future__ import annotations

import pytest

# arithmetic_examples, digit_share, make_config: transitional re-exports for tests written in parallel
# that still import them from here; switch those to tests.helpers, then import build_tiny_model only.
from tests.helpers import arithmetic_examples, build_tiny_model, digit_share, make_config  # noqa: F401


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
