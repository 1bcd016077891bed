"""The house's shape: layers only look down, no import circle, no module uses another's private name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "scdviz").rglob("*.py"), *(ROOT / "research").glob("*.py"), *(ROOT / "tests").glob("*.py"),
                  ROOT / "app.py"])
# who may import whom: a module imports only modules of its own layer or of lower ones (prefix -> layer)
GROUND = ("scdviz.settings", "scdviz.config", "scdviz.metrics", "scdviz.link", "scdviz.figures",
          "scdviz.progress")  # import no scdviz
LAYERS = {**dict.fromkeys(GROUND, 0), "scdviz.models": 1, "scdviz.scd": 3, "scdviz.evict": 3,
          "scdviz.modelcard": 4, "scdviz.commands": 4, "scdviz.report": 4,  # tools over both methods
          "scdviz.serving": 4,  # the codec inside a serving engine (its own environment)
          "scdviz.app": 5, "scdviz.cli": 6, "scdviz.__main__": 6}
LIBRARY = 2  # every other module of scdviz: data, records, artefact, plots, ...


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) of every import of a scdviz / research / tests module."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = here.split(".")[: len(here.split(".")) - node.level + (1 if path.name == "__init__.py" else 0)]
                base = ".".join([*pkg, base] if base else pkg)
            out.append((base, [a.name for a in node.names], node.lineno))
    return [(m, names, line) for m, names, line in out if m.split(".")[0] in ("scdviz", "research", "tests")]


def _layer(module: str) -> int:
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return LIBRARY


def _is_module(name: str) -> bool:
    return (ROOT / Path(*name.split("."))).with_suffix(".py").is_file() or (ROOT / Path(*name.split("."))).is_dir()


@pytest.mark.parametrize("path", [p for p in SOURCES if p.is_relative_to(ROOT / "scdviz")], ids=lambda p: _module(p))
def test_a_library_module_imports_nothing_above_its_layer(path):
    here = _module(path)
    for module, names, line in _imports(path):
        if not module.startswith("scdviz"):
            continue
        targets = [f"{module}.{n}" if _is_module(f"{module}.{n}") else module for n in names] or [module]
        for target in targets:
            if here == "scdviz" or target == "scdviz":  # the package face hands names on, lazily
                continue
            assert _layer(target) <= _layer(here), f"{here}:{line} imports {target} from a layer above it"
            sibling = {here.split(".")[1], target.split(".")[1]} == {"scd", "evict"}
            assert not sibling, f"{here}:{line}: the two methods do not import each other ({target})"


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    for path in (p for p in SOURCES if p.is_relative_to(ROOT / "scdviz")):
        here = _module(path)
        for module, names, _ in _imports(path):
            targets = [f"{module}.{n}" if _is_module(f"{module}.{n}") else module for n in names] or [module]
            graph.setdefault(here, set()).update(t for t in targets if t != here and t != "scdviz")
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*trail[trail.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_uses_another_modules_private_name(path):
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}  # local name -> the scdviz / research / tests module it is bound to
    bad = []
    for module, names, line in _imports(path):
        bad += [f"{line}: from {module} import {n}" for n in names if n.startswith("_") and n != "__version__"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("scdviz", "research"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("scdviz", "research", "tests"):
            for a in node.names:
                if _is_module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, f"{path.relative_to(ROOT)} uses private names of other modules: {bad}"


def test_ruff_is_clean():
    """The lint rules of pyproject.toml hold (private imports, argument counts, line length, imports)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
