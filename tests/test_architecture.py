"""The import-layer contract of docs/architecture.md, checked from the source with ``ast``.

Every module of the installed package (``replayssm_quant``, with ``evals/`` and ``analysis/``
as ``replayssm_quant.evals`` / ``replayssm_quant.analysis``) belongs to one room; a room may
import only the rooms listed for it in ``ALLOWED``. Imports inside functions count too (a lazy
import is still a dependency), except that the backend seam must import kernels lazily, so that
importing the package never loads Triton. Finally the module graph has no cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = "replayssm_quant"
# source folder -> installed package name (pyproject.toml package-dir)
SOURCES = {ROOT / PKG: PKG, ROOT / "evals": f"{PKG}.evals", ROOT / "analysis": f"{PKG}.analysis"}

# Rooms, lowest first. A module belongs to the room of the longest matching prefix.
ROOMS = {
    # "config": the parsed StateConfig of the parse-once change (imports only policy), a leaf
    # "policymap": per-layer/per-head policy maps (issue 18), parsed at the edges, a leaf
    # "outpaths": the command-line tools' output-path check (stdlib only), a leaf
    "leaf": ["formats", "philox", "packed", "checkpoints", "capabilities", "policy", "policymap",
             "config", "outpaths"],
    "kernels": ["kernels"],
    "backend": ["backend"],
    "reference": ["quant", "reference", "replay"],
    "adapters": ["adapters"],
    "assets": ["models", "data"],
    "runners": ["evals", "analysis"],
}
FACADE = PKG  # the package root: the public names, re-exported
ALLOWED = {
    "leaf": {"leaf"},
    "kernels": {"leaf", "kernels"},
    "backend": {"leaf", "kernels"},  # kernels: inside functions only (checked below)
    "reference": {"leaf", "backend", "reference"},
    "adapters": {"leaf", "backend", "reference", "adapters"},
    "assets": {"leaf", "assets"},
    "facade": {"leaf", "backend", "reference", "adapters", "assets"},
    "runners": {"leaf", "backend", "reference", "adapters", "assets", "facade", "runners"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for src, name in SOURCES.items():
        for f in sorted(src.rglob("*.py")):
            rel = f.relative_to(src).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            mods[".".join((name, *rel))] = f
    return mods


MODULES = _modules()


def room(mod: str) -> str | None:
    if mod == FACADE:
        return "facade"
    if not mod.startswith(PKG + "."):
        return None  # outside the package
    rest = mod[len(PKG) + 1:]
    for r, prefixes in ROOMS.items():
        if any(rest == p or rest.startswith(p + ".") for p in prefixes):
            return r
    raise AssertionError(f"module {mod} belongs to no room: add it to ROOMS "
                         "(and to docs/architecture.md)")


def _imports(mod: str, path: Path):
    """(target module, line, inside a function) of every import of ``mod``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    out = []

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    out.append((sub if sub in MODULES else target, child.lineno, in_func))
            visit(child, f)

    visit(tree, False)
    return sorted(set(out))


EDGES = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_room():
    assert {m: room(m) for m in MODULES}  # raises for a module in no room
    assert "replayssm_quant.evals.kl" in MODULES and "replayssm_quant.analysis.theory" in MODULES


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_follow_the_layers(mod):
    src = room(mod)
    bad = []
    for target, line, lazy in EDGES[mod]:
        dst = room(target)
        if dst is None:
            if target.split(".")[0] in ("evals", "analysis"):
                bad.append(f"line {line}: {target} (the old top-level name; use {PKG}.{target})")
            continue
        if dst not in ALLOWED[src] and dst != src:
            bad.append(f"line {line}: {target} ({dst}) from the {src} room")
        if src == "backend" and dst == "kernels" and not lazy:
            bad.append(f"line {line}: {target} at module level (the seam imports kernels lazily)")
    assert not bad, f"{mod} breaks docs/architecture.md:\n" + "\n".join(bad)


def test_triton_only_in_kernels():
    for mod, edges in EDGES.items():
        if room(mod) != "kernels":
            assert not [t for t, _, _ in edges if t.split(".")[0] == "triton"], mod


def test_no_import_cycles():
    graph = {m: sorted({t for t, _, _ in EDGES[m] if t in MODULES and t != m}) for m in MODULES}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def strong(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, f"import cycles: {cycles}"


def test_leaves_import_only_leaves():
    for mod in MODULES:
        if room(mod) == "leaf":
            assert all(room(t) in (None, "leaf") for t, _, _ in EDGES[mod]), mod
