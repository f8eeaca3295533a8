"""The package layout keeps its layers (``docs/architecture.md``): read from the source, every import of a
``lightning_llm`` module, module-level or inside a function, goes to a lower layer or stays in its own package, and
no imports close a circle."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_llm"

# docs/architecture.md's layer table: module or package (longest prefix wins) -> layer, lowest first.
LAYERS = {
    "files": 0, "logs": 0, "checkpoint": 0, "contract": 0, "kernels": 0, "metrics": 0,
    "models": 1, "reliability": 1,
    "data": 2, "generation": 2, "strategies": 2, "optim": 2,
    "vocab": 3, "memory": 3, "preemption": 3,
    "peft": 4, "run_summary": 4, "tools": 4,
    "export": 5, "rl": 5,
    "tasks": 6,
    "evaluation": 7,
    "cli": 8,
    "testing": 9, "__main__": 9,
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source ('' is ``lightning_llm`` itself)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = [p for p in pkg[: len(pkg) - node.level + 1] if p]
                    base = ".".join(["lightning_llm", *anchor, *([base] if base else [])])
                # ``from pkg import sub`` imports the submodule; any other name comes from ``pkg`` itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}".removeprefix("lightning_llm.") in mods else base
                           for a in node.names]
            else:
                continue
            for t in targets:
                if t != "lightning_llm" and not t.startswith("lightning_llm."):
                    continue
                t = t.removeprefix("lightning_llm").removeprefix(".")
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t != name and not name.startswith(t + ".") and not (t == "" and name == ""):
                    edges[name].add(t)
    return edges


def _with_packages(mods: dict[str, Path], edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The edges plus the packages a target's import runs first: importing ``a.b.c`` runs ``a/__init__.py`` and
    ``a/b/__init__.py`` (a module in layer 0 inside a package of a higher layer would pull that layer in, and a
    circle through a package's ``__init__`` fails only when one of its modules is imported first)."""
    packages = {n for n, f in mods.items() if f.name == "__init__.py" and n}
    out: dict[str, set[str]] = defaultdict(set)
    for name, targets in edges.items():
        out[name] |= targets
        for t in targets:
            parts = t.split(".")
            for k in range(1, len(parts)):
                pkg = ".".join(parts[:k])
                if pkg in packages and name != pkg and not name.startswith(pkg + "."):
                    out[name].add(pkg)
    return out


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in LAYERS:
            return ".".join(parts[:k]), LAYERS[".".join(parts[:k])]
    raise AssertionError(f"lightning_llm.{module} is in no layer of LAYERS: add it (and to docs/architecture.md)")


def test_every_import_goes_down_a_layer() -> None:
    mods = _modules()
    upward = []
    for name, targets in _with_packages(mods, _imports(mods)).items():
        if name == "":
            continue
        group, layer = _layer(name)
        for t in targets:
            assert t != "", f"lightning_llm.{name} imports the lightning_llm package itself"
            t_group, t_layer = _layer(t)
            if t_group != group and t_layer >= layer:
                upward.append(f"lightning_llm.{name} (layer {layer}) -> lightning_llm.{t} (layer {t_layer})")
    assert not upward, "imports that do not go to a lower layer:\n" + "\n".join(sorted(upward))


def test_no_import_circles() -> None:
    mods = _modules()
    edges = _with_packages(mods, _imports(mods))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                circles.append(" <-> ".join(sorted(comp)))

    for v in list(edges):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(circles)
