"""Which function: ``"path.py:function"`` specs, callables turned into specs, code hashes.

A :class:`FnSpec` names a function by the file that defines it and its
qualified name, and carries the SHA-256 of that file: the code hash that
records and the deduplication of identical requests use.  Workers load the
file afresh under a private module name (:func:`load`), so a worker never
serves an old copy of a file that was edited between two evaluations.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from krex.errors import BadRequest


@dataclass(frozen=True)
class FnSpec:
    path: str  # absolute path of the defining file
    name: str  # qualified name inside it ("make", "Kernels.fast")
    sha256: str  # of the file's bytes

    @property
    def text(self) -> str:
        return f"{self.path}:{self.name}"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> FnSpec:
        return cls(str(data["path"]), str(data["name"]), str(data["sha256"]))


READS = "# krex reads: "  # a line of a spec's file naming another file it loads


def reads(path: str) -> list[str]:
    """The files ``path`` says it loads (its ``# krex reads: PATH`` lines, in its first
    4 KiB: a generated module's, such as a KernelBench pair's), which whoever runs it
    must be able to read too."""
    try:
        with open(path) as f:
            head = f.read(4096)
    except OSError:
        return []
    return [line[len(READS):].strip() for line in head.splitlines() if line.startswith(READS)]


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def parse(text: str, role: str) -> FnSpec:
    """``"dir/ref.py:fn"`` -> FnSpec (the file must exist and bind the name's first part at
    its top level, as read from its source; the worker checks the rest)."""
    path, sep, name = text.rpartition(":")
    if not sep or not path or not name or not path.endswith(".py"):
        raise BadRequest(f"{role} {text!r} is not PATH.py:FUNCTION",
                         hint=f"name the {role} as file.py:function_name")
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise BadRequest(f"{role} file {path} does not exist", hint="check the path")
    _check_defined(path, name, role)
    return FnSpec(path, name, file_sha256(path))


def _check_defined(path: str, name: str, role: str) -> None:
    """Refuse a name the file does not bind at its top level, listing those it does (read
    from the source, nothing run).  A file that cannot be read so is left to the worker."""
    bound = top_level_names(path)
    first = name.split(".")[0]
    if bound is None or first in bound:
        return
    defined = sorted(n for n, is_def in bound.items() if is_def and not n.startswith("_"))
    close = difflib.get_close_matches(first, list(bound), n=1)
    raise BadRequest(f"{role} file {path} has no function {name!r}",
                     hint=(f"did you mean {close[0]!r}? " if close else "")
                     + f"it defines: {', '.join(defined) or 'no functions'}")


def top_level_names(path: str) -> dict[str, bool] | None:
    """The names a file binds at its top level (True: by ``def`` or ``class``); None
    where that cannot be known without running it (a syntax error, ``import *``, a
    module ``__getattr__``)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    names: dict[str, bool] = {}
    for node in tree.body:
        for bound, is_def in _binds(node):
            if bound in ("*", "__getattr__"):
                return None
            names[bound] = names.get(bound, False) or is_def
    return names


def _binds(node: ast.stmt) -> list[tuple[str, bool]]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [(node.name, True)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [((a.asname or a.name).split(".")[0], False) for a in node.names]
    # assignments, and names bound inside if/try/with/for at the top level
    return [(n.id, False) for n in ast.walk(node)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)] + \
        [(d.name, True) for d in ast.walk(node) if d is not node and
         isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def of(value: str | Callable[..., Any], role: str) -> FnSpec:
    """A spec from a spec string or from a module-level function (or method) defined in a file."""
    if isinstance(value, str):
        return parse(value, role)
    if not callable(value):
        raise BadRequest(f"{role} must be a callable or 'path.py:function', not {type(value)}")
    qualname = getattr(value, "__qualname__", "")
    try:
        path = inspect.getsourcefile(value)
    except TypeError:
        path = None
    if not path or "<" in qualname or not qualname:
        raise BadRequest(f"{role} {value!r} is not a module-level function defined in a file",
                         hint="define it with def at the top level of a .py file, or pass "
                              "'path.py:function'")
    return FnSpec(os.path.abspath(path), qualname, file_sha256(path))


def load(spec: FnSpec, role: str) -> Callable[..., Any]:
    """Import the spec's file under a private module name and return the function.

    Each call within one program imports the file once per role (the module is
    put in ``sys.modules`` so that pickling and dataclasses inside it work; the
    worker removes it after the program).
    """
    module_name = f"_krex_{role}_{spec.sha256[:16]}"
    module = sys.modules.get(module_name)
    if module is None:
        module = _import(spec.path, module_name, role)
    target: Any = module
    for part in spec.name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise BadRequest(f"{spec.path} has no {spec.name!r}",
                             hint=f"check the {role}'s function name")
    if not callable(target):
        raise BadRequest(f"{spec.text} is not callable")
    return target


def _import(path: str, module_name: str, role: str) -> Any:
    found = importlib.util.spec_from_file_location(module_name, path)
    if found is None or found.loader is None:
        raise BadRequest(f"cannot import {path} as the {role}")
    module = importlib.util.module_from_spec(found)
    sys.modules[module_name] = module
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)  # its sibling modules import as they would from a script
    found.loader.exec_module(module)
    return module
