"""Which function: ``"path.py:function"`` specs, callables turned into specs, code hashes.

A :class:`FnSpec` names a function by the file that defines it and its
qualified name, and carries the SHA-256 of that file: the code hash that
records and the deduplication of identical requests use.  Workers load the
file afresh under a private module name (:func:`load`), so a worker never
serves an old copy of a file that was edited between two evaluations.
"""

from __future__ import annotations

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


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def parse(text: str, role: str) -> FnSpec:
    """``"dir/ref.py:fn"`` -> FnSpec (the file must exist; the name is checked in the worker)."""
    path, sep, name = text.rpartition(":")
    if not sep or not path or not name or not path.endswith(".py"):
        raise BadRequest(f"{role} {text!r} is not PATH.py:FUNCTION",
                         hint=f"name the {role} as file.py:function_name")
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise BadRequest(f"{role} file {path} does not exist", hint="check the path")
    return FnSpec(path, name, file_sha256(path))


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
