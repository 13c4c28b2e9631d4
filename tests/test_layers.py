"""The allowed dependency direction between krex's packages, read from the imports (ast).

docs/architecture.md states the layers; this test holds the code to them, so
no change breaks them silently: every ``import`` of a krex module — at module
level, inside a function, or under ``TYPE_CHECKING`` — must go from a package
to one it may depend on.  A new package must be added here (and to the
architecture document) before it can import anything.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
from helpers import REPO

KREX = Path(REPO) / "krex"
ARCHITECTURE = Path(REPO) / "docs" / "architecture.md"

# Modules every layer may use: they import nothing of krex.
BASE = {"errors", "lazy", "memtrace", "resultfile", "version"}

# package -> the packages it may import (not transitive; BASE is always allowed).
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "devices": {"protocol"},
    "enforce": {"devices", "protocol"},
    "workers": {"enforce", "devices", "protocol"},
    "client": {"workers", "enforce", "devices", "protocol"},
    "measure": {"client", "devices", "protocol"},
    "daemon": {"workers", "enforce", "devices", "protocol"},
    "eval": {"measure", "client", "workers", "devices", "protocol"},
    "integrations": {"measure", "client", "workers", "devices", "protocol"},
    "records": {"protocol"},
    "evaluate": {"records", "measure", "client", "workers", "enforce", "devices", "protocol",
                 "_native"},  # _native: the sealed call loop, a CPython extension
    "service": {"evaluate", "records", "measure", "client", "workers", "devices", "protocol"},
    # The front ends: nothing imports them.
    "krex": {"evaluate", "client", "measure", "protocol"},  # the package root: public names
    "cli": {"service", "evaluate", "records", "eval", "integrations", "daemon", "measure",
            "client", "workers", "enforce", "devices", "protocol"},
    "ray": {"integrations"},  # krex.ray: the public alias of krex.integrations.ray
    "__main__": {"cli"},
    "_native": set(),
    **{name: set() for name in BASE},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(KREX.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "krex"


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in KREX.rglob("*.py")}


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for n in ast.walk(node))
    return out


def imported(path: Path, known: dict[str, Path], typing: bool = True) -> set[str]:
    """The krex modules ``path`` imports (anywhere in it; under ``TYPE_CHECKING`` only when
    ``typing``), resolved to modules that exist."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    skip = set() if typing else _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in known else base)
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith("krex") and name != me:
            out.add(name)
    return out


def graph(typing: bool = True) -> dict[str, set[str]]:
    known = modules()
    return {m: imported(p, known, typing) for m, p in known.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            a, b = layer(src), layer(dst)
            if a != b and b not in BASE and b not in ALLOWED.get(a, set()):
                bad.append(f"{src} -> {dst} ({a} may not import {b})")
    return bad


def test_every_package_declares_its_layer():
    undeclared = {layer(m) for m in modules()} - set(ALLOWED)
    assert undeclared == set(), f"add {undeclared} to ALLOWED and docs/architecture.md"


def test_imports_follow_the_allowed_direction():
    assert violations(graph()) == []


def test_a_forbidden_import_is_caught():
    """Negative control: the edges this issue removed would fail the test."""
    for src, dst in [("krex.daemon.pools", "krex.client.job"), ("krex.eval.serve", "krex.cli.main"),
                     ("krex.devices.selftest", "krex.enforce.gate"),
                     ("krex.protocol.report", "krex.enforce.process")]:
        assert violations({src: {dst}}), (src, dst)
    assert violations({"krex.client.region": {"krex.daemon.core"}})  # siblings stay apart
    assert not violations({"krex.daemon.pools": {"krex.workers.launcher"}})


def test_relative_and_lazy_imports_are_read(tmp_path):
    tree = KREX / "daemon" / "core.py"
    assert "krex.protocol.report" in imported(tree, modules())
    lazy = KREX / "measure" / "regions.py"  # imports the client inside a function
    assert "krex.client.region" in imported(lazy, modules())


def test_no_import_cycles_between_modules():
    """At run time (annotations may name a module that imports this one)."""
    edges = graph(typing=False)
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if seen.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for start in sorted(edges):
        if start not in seen:
            visit(start, [start])
    # A package's __init__ re-exporting its own modules is not a cycle worth naming.
    real = [c for c in cycles if not all(m.startswith(c[0]) or c[0].startswith(m) for m in c)]
    assert real == []


def _sections() -> dict[str, str]:
    """docs/architecture.md's paragraph per package (from its bold name to the next)."""
    text = ARCHITECTURE.read_text()
    parts = re.split(r"\*\*`(krex\.[a-z_.]+)`\*\*", text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize("package", sorted({layer(m) for m in modules()} - {"krex"}))
def test_architecture_names_every_module(package):
    text = ARCHITECTURE.read_text()
    mods = sorted(m for m in modules() if layer(m) == package)
    if package in BASE or package in ("ray", "__main__", "_native"):
        assert f"`krex/{package}" in text or f"`krex.{package}`" in text, package
        return
    section = _sections().get(f"krex.{package}", "")
    assert section, f"docs/architecture.md has no **`krex.{package}`** paragraph"
    missing = [m for m in mods if m.count(".") >= 2 and m.rsplit(".", 1)[-1] != "__init__"
               and f"`{m.rsplit('.', 1)[-1]}`" not in section]
    assert missing == [], f"not named in the krex.{package} paragraph: {missing}"


def test_architecture_states_every_allowed_edge():
    text = ARCHITECTURE.read_text()
    table = text[text.index("## Dependency direction"):]
    for package, allowed in ALLOWED.items():
        if package in BASE or package in ("_native", "__main__"):
            continue
        row = next((line for line in table.splitlines()
                    if line.startswith(f"| `{package}`")), None)
        assert row is not None, f"no row for {package} in the dependency table"
        named = set(re.findall(r"`([a-z_]+)`", row.split("|")[2]))
        assert named == allowed, (package, named, allowed)


def test_package_docstrings_say_what_comes_in_and_goes_out():
    for init in sorted(KREX.glob("*/__init__.py")):
        if init.parent.name == "_native":
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc and "TODO" not in doc, init
        assert re.search(r"\bIn\b|comes in", doc) and re.search(r"\bOut\b|goes out", doc), init


def test_the_test_sees_the_whole_tree():
    assert len(modules()) > 100 and all(os.path.exists(p) for p in modules().values())
