"""Every import in src/bapo points down the layering (docs/ARCHITECTURE.md):

    core  <-  train  <-  analysis  <-  lab  <-  experiments
    core, train  <-  integrations.verl, integrations.trl          cli may import anything

`bapo.core` is torch + numpy + the standard library only, and imports nothing heavy at run time.
Imports are read with `ast` (function-level and TYPE_CHECKING imports count too), so a
violation is reported with its file and line before anything is executed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "bapo"

# The bapo layers each layer may import (besides itself and the bare `bapo` package).
ALLOWED_LAYERS: dict[str, set[str]] = {
    "core": set(),
    "train": {"core"},
    "analysis": {"core", "train"},
    "experiments": {"core", "train", "analysis", "lab"},  # the demo runs the lab first
    "lab": {"core", "train", "analysis"},
    # the package's own __init__, and verl_plugin.py: verl's entry point, which imports bapo.integrations.verl
    "integrations": {"integrations.verl"},
    "integrations.verl": {"core", "train", "integrations"},
    "integrations.trl": {"core", "train", "integrations"},
    "cli": {"core", "train", "analysis", "experiments", "lab", "integrations", "integrations.verl", "integrations.trl"},
    "__main__": {"cli"},  # `python -m bapo`
}
# Third-party packages bapo.core may import; everything else it imports must be the standard library.
CORE_THIRD_PARTY = {"torch", "numpy"}
# Frameworks only their integration imports (the rest of bapo must work without them installed).
FRAMEWORK_HOME = {"verl": "integrations.verl", "ray": "integrations.verl", "trl": "integrations.trl"}
# Heavy modules a bare `import bapo.core` must not load.
NOT_LOADED_BY_CORE = ("transformers", "trl", "verl", "datasets", "rich", "typer", "pydantic", "yaml", "matplotlib")


@dataclass(frozen=True)
class Import:
    file: Path  # the importing module's file
    line: int
    module: str  # absolute dotted name of what is imported, e.g. "bapo.core.search"
    statement: str  # the source text, for the failure message


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    path = SRC.joinpath(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").exists()


def imports_of(path: Path) -> list[Import]:
    """Every import statement in the file (any nesting), relative imports made absolute."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: "." is `package`, each further dot one level up
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from bapo.experiments import model` imports the module bapo.experiments.model; `import Name` imports base
            names = [f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base for alias in node.names]
        else:
            continue
        text = ast.get_source_segment(source, node) or ""
        found += [Import(path, node.lineno, name, " ".join(text.split())) for name in names]
    return found


def layer_of(module: str) -> str:
    """ "bapo.integrations.trl.trainer" -> "integrations.trl"; "bapo.core.search" -> "core"; "bapo" -> ""."""
    parts = module.split(".")[1:]
    if parts[:1] == ["integrations"] and len(parts) > 1 and (PACKAGE / "integrations" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0] if parts else ""


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def where(imp: Import) -> str:
    return f"src/{imp.file.relative_to(SRC)}:{imp.line}: `{imp.statement}`"


def test_every_source_file_belongs_to_a_known_layer():
    unknown = {layer_of(module_name(path)) for path in source_files()} - set(ALLOWED_LAYERS) - {""}
    assert not unknown, (
        f"new package(s) {sorted(unknown)} under src/bapo: add them to ALLOWED_LAYERS in "
        f"tests/test_layering.py and to docs/ARCHITECTURE.md"
    )


def test_bapo_imports_point_down_the_layering():
    violations = []
    for path in source_files():
        own = layer_of(module_name(path))
        allowed = ALLOWED_LAYERS[own] | {own} if own else set()
        for imp in imports_of(path):
            target = layer_of(imp.module) if imp.module.split(".")[0] == "bapo" else ""
            if target == "" or target in allowed:
                continue
            may = ", ".join(f"bapo.{layer}" for layer in sorted(allowed)) or "nothing from bapo"
            violations.append(f"{where(imp)} imports bapo.{target}, but bapo.{own or '(root)'} may import {may}")
    layering = "core <- train <- analysis <- lab <- experiments; integrations: core, train"
    assert not violations, f"imports against the layering ({layering}):\n" + "\n".join(violations)


def test_core_imports_only_torch_numpy_and_the_standard_library():
    violations = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for imp in imports_of(path):
            top = imp.module.split(".")[0]
            if top in ("bapo", "__future__") or top in CORE_THIRD_PARTY or top in sys.stdlib_module_names:
                continue
            violations.append(f"{where(imp)}: bapo.core is torch + numpy only; move this to bapo.train or above")
    assert not violations, "\n".join(violations)


def test_frameworks_are_imported_only_by_their_integration():
    violations = []
    for path in source_files():
        own = layer_of(module_name(path))
        for imp in imports_of(path):
            home = FRAMEWORK_HOME.get(imp.module.split(".")[0])
            if home is not None and own != home:
                violations.append(f"{where(imp)}: only bapo.{home} may import {imp.module.split('.')[0]}")
    assert not violations, "\n".join(violations)


def test_import_bapo_core_loads_no_heavy_package():
    probe = f"import sys, bapo.core\nprint(' '.join(m for m in {NOT_LOADED_BY_CORE!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"`import bapo.core` also imported {done.stdout.split()}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from bapo.experiments import model\n", "bapo.experiments.model"),
        ("from ..core import search\n", "bapo.core.search"),
        ("from . import buffer\n", "bapo.train.buffer"),
        ("def f():\n    import bapo.analysis.claims\n", "bapo.analysis.claims"),
    ],
)
def test_import_reader_resolves_relative_nested_and_submodule_imports(tmp_path, monkeypatch, source, expected):
    # the checker itself must not miss the forms it claims to read
    fake_src = tmp_path / "src"
    for package in ("bapo", "bapo/core", "bapo/train", "bapo/experiments", "bapo/analysis"):
        (fake_src / package).mkdir(parents=True, exist_ok=True)
        (fake_src / package / "__init__.py").write_text("")
    for module in (
        "bapo/core/search.py",
        "bapo/train/buffer.py",
        "bapo/experiments/model.py",
        "bapo/analysis/claims.py",
    ):
        (fake_src / module).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake_src)
    probe = fake_src / "bapo" / "train" / "probe.py"
    probe.write_text(source)
    assert [imp.module for imp in imports_of(probe)] == [expected]
