"""The package layout as an import rule (docs/architecture.md, "Layout"): the packages are layers, and each imports
only from the layers below it, so the two workers never import each other, and nothing imports the api, the bench or
training but what sits above them. Read from the source with `ast`, lazy imports inside functions included."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import foresight

ROOT = Path(foresight.__file__).parent
# Lowest first; a top-level module counts as the package of its name ("config" for config.py).
LAYERS = [
    {"protocol"},  # messages, codec, sockets, transport, liveness: what every process shares
    {"config"},  # the engine's settings
    {"placement", "spec", "models"},  # where each process runs; verification and sampling; models and kernels
    {"control"},  # estimators and the round planner
    {"target_worker", "drafter_worker"},  # the two worker processes: never each other
    {"server"},  # the api process
    {"bench"},  # benchmarks (start servers)
    {"training"},  # training and labelling (run the engine, read the bench's evaluation sets)
    {"cli", "__init__"},
]


def layer_of(package: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package in names)

def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def imported_packages(path: Path) -> set[str]:
    """The top-level foresight packages `path` imports (relative imports resolved)."""
    pkg = list(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            else:
                base = (node.module or "").split(".")
            if base[0] == "foresight" and len(base) > 1:
                found.add(base[1])
            elif base == ["foresight"]:
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("foresight.")}
    return found


def test_every_package_has_a_layer():
    for path in ROOT.rglob("*.py"):
        layer_of(package_of(path))


def test_imports_run_downward_only():
    edges = {}
    for path in ROOT.rglob("*.py"):
        own = package_of(path)
        for target in imported_packages(path) - {own}:
            edges.setdefault((own, target), []).append(str(path.relative_to(ROOT)))
    wrong = {edge: files for edge, files in edges.items() if layer_of(edge[1]) >= layer_of(edge[0])}
    assert not wrong, "imports against the layout: " + "; ".join(f"{a} -> {b}: {f}" for (a, b), f in wrong.items())
    assert ("target_worker", "spec") in edges and ("drafter_worker", "spec") in edges  # the rule reads real imports


def test_the_rule_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    fake = tmp_path / "foresight"
    (fake / "target_worker").mkdir(parents=True)
    module = fake / "target_worker" / "m.py"
    module.write_text("from ..drafter_worker.x import y\n\ndef f():\n    from foresight.server import app\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert imported_packages(module) == {"drafter_worker", "server"}
