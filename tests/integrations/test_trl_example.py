"""examples/trl/bapo_grpo.py runs end to end (2 optimizer steps on the tiny model) and prints bapo's metrics."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl" / "bapo_grpo.py"


def test_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "2", "--output-dir", str(tmp_path)])
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # as `python examples/trl/bapo_grpo.py` has: tiny_task.py
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    table = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(table) if line.startswith("step "))
    assert "bapo/upper" in table[header]
    assert [line.split()[0] for line in table[header + 1 : header + 3]] == ["1", "2"]
