"""Lazy re-exports for package roots (PEP 562): ``import krex`` costs nothing it does not use.

A package's ``__init__`` names its public objects and the module each lives in;
the module is imported on the first access of a name, and the name is then
cached in the package.  The names are also imported under ``TYPE_CHECKING``
so type checkers see them.  Imports nothing of krex.
"""

from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (CLI start-up)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any],
                                                               Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps a public name to
    ``"module:attribute"``, or to ``"module"`` when the name is that module itself."""

    def getattr_(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where.partition(":")
        value = importlib.import_module(module)
        if attribute:
            value = getattr(value, attribute)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return getattr_, dir_
