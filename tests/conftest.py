"""Suite-wide: `make test-vllm` sets BAPO_REQUIRE_VLLM=1, so the vLLM tests fail, not skip, when
vllm is missing there (a skipped engine test must not read as a passing one)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("BAPO_REQUIRE_VLLM") != "1":
        return
    if importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("BAPO_REQUIRE_VLLM=1 but vllm is not importable: run `make vllm` (bapo[vllm])")
    if not any(item.get_closest_marker("vllm") for item in items):
        raise pytest.UsageError("BAPO_REQUIRE_VLLM=1 but no test marked vllm was collected")
