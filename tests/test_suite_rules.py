"""The suite's own rules, read from its sources (ast): no test module imports another.

What several test modules share lives in conftest.py (fixtures) or in a support module
(helpers.py, fakes.py, ``*_support.py``, ...), never in a ``test_*.py``: so a test
module is read and run on its own, collecting one does not import (and run the module
code of) others, and moving a test cannot break a file that borrowed from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import REPO

TESTS = Path(REPO) / "tests"


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def imports_of_test_modules(source: str) -> list[str]:
    """``line: module`` for each import of a test module in ``source``: ``import``,
    ``from ... import`` (at any depth, absolute or relative) and ``importlib``'s
    ``import_module`` or ``__import__`` with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if node.level or node.module == "tests":  # from . import <a test module>
                names += [a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                names = [node.args[0].value]
        found += [f"{node.lineno}: {n}" for n in names if _is_test_module(n)]
    return found


def test_no_module_of_the_suite_imports_a_test_module():
    modules = sorted(TESTS.glob("*.py"))
    assert len([p for p in modules if p.name.startswith("test_")]) > 50  # it read the suite
    found = {p.name: imports_of_test_modules(p.read_text()) for p in modules}
    assert not {name: lines for name, lines in found.items() if lines}, \
        "move what they share to conftest.py or a support module (tests/*_support.py)"


# The sources name test modules as "{t}...", so that a grep of the suite for imports of
# test modules finds none here either.
@pytest.mark.parametrize("source", [
    "from {t}native import build_c\n",
    "import os, {t}gate\n",
    "import {t}gate as gate\n",
    "def drainer():\n    from {t}native import build_c\n    return build_c\n",
    "from . import {t}gate\n",
    "from tests.{t}requeue import _start\n",
    "import importlib\nrequeue = importlib.import_module('{t}requeue')\n",
])
def test_an_import_of_a_test_module_is_found(source):
    """Negative control: each way of importing a test module is flagged, at its line."""
    source = source.format(t="test_")
    found = imports_of_test_modules(source)
    assert len(found) == 1 and "test_" in found[0], found
    assert found[0].split(":")[0] == str(source.count("\n", 0, source.index("test_")) + 1)


def test_imports_of_support_modules_are_not_flagged():
    """Control: support modules, a module merely named test-something, and a function
    called test_... imported from a module that is not a test module."""
    source = ("import pytest\nfrom helpers import PY\nfrom native_support import build_c\n"
              "from fakes import FakeSession\nimport testinfra\nfrom x import {t}y\n"
              ).format(t="test_")
    assert imports_of_test_modules(source) == []
