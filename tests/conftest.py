"""Suite-wide: `make test` runs the tests marked vllm with BAPO_REQUIRE_VLLM=1 and those marked
verl (in .venv-verl) with BAPO_REQUIRE_VERL=1; then the package must be importable, some such test
must be collected, and a test of that kind that skips fails instead (a skipped engine test must not
read as a passing one)."""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = {"vllm": "BAPO_REQUIRE_VLLM", "verl": "BAPO_REQUIRE_VERL"}


def required() -> list[str]:
    """The markers whose tests must run here (their BAPO_REQUIRE_* is 1)."""
    return [marker for marker, env in REQUIRE_ENV.items() if os.environ.get(env) == "1"]


def pytest_collection_modifyitems(config, items):
    for marker in required():
        env = REQUIRE_ENV[marker]
        if importlib.util.find_spec(marker) is None:
            raise pytest.UsageError(f"{env}=1 but {marker} is not importable: run `make test` (it installs it)")
        if not any(item.get_closest_marker(marker) for item in items):
            raise pytest.UsageError(f"{env}=1 but no test marked {marker} was collected")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    needed = [m for m in required() if item.get_closest_marker(m)]
    if report.skipped and needed and not item.get_closest_marker("gpu"):
        report.outcome = "failed"
        report.longrepr = f"skipped although {REQUIRE_ENV[needed[0]]}=1: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    reason = str(report.longrepr) if report.skipped else ""
    needed = [m for m in required() if m in reason]
    if needed:  # a module-level importorskip of the required package (or of a part of it)
        report.outcome = "failed"
        report.longrepr = f"module skipped although {REQUIRE_ENV[needed[0]]}=1: {reason}"
