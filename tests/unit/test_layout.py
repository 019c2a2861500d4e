"""The package layout as an import rule (docs/architecture.md, "Layout"): imports run downward only. The worker
packages import neither each other nor the api, the bench or training; the api imports neither bench nor training;
what both workers share (spec, control, models, protocol) imports no worker. Read from the source with `ast`, lazy
imports inside functions included."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import foresight

ROOT = Path(foresight.__file__).parent
PROCESS_PACKAGES = {"target_worker", "drafter_worker", "server"}
TOOLS = {"bench", "training", "cli"}
SHARED = {"spec", "control", "models", "protocol", "config"}
FORBIDDEN = {
    "target_worker": {"drafter_worker", "server"} | TOOLS,
    "drafter_worker": {"target_worker", "server"} | TOOLS,
    "server": {"target_worker", "drafter_worker"} | TOOLS,
    **{name: PROCESS_PACKAGES | TOOLS for name in SHARED},
}


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


def test_imports_run_downward_only():
    edges = {}
    for path in ROOT.rglob("*.py"):
        own = package_of(path)
        for target in imported_packages(path) - {own}:
            edges.setdefault((own, target), []).append(str(path.relative_to(ROOT)))
    wrong = {edge: files for edge, files in edges.items() if edge[1] in FORBIDDEN.get(edge[0], set())}
    assert not wrong, "imports against the layout: " + "; ".join(f"{a} -> {b}: {f}" for (a, b), f in wrong.items())
    assert ("target_worker", "spec") in edges and ("drafter_worker", "spec") in edges  # the rule reads real imports


def test_the_rule_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    fake = tmp_path / "foresight"
    (fake / "target_worker").mkdir(parents=True)
    module = fake / "target_worker" / "m.py"
    module.write_text("from ..drafter_worker.x import y\n\ndef f():\n    from foresight.server import app\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert imported_packages(module) == {"drafter_worker", "server"}
