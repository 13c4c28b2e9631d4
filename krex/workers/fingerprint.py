"""Identities of a set of modules' bindings: has anything rebound or replaced them?

In: module names.  Out: ``{(module, attr): identity}`` for every binding of
those modules and of the classes they define — for a function, the identity
of its code object, defaults and keyword defaults as well — and
:func:`changes`, the names that differ between two fingerprints.  Used by the
canary (krex's own modules, preloaded into every worker, must be as they were
when the worker started) and by ``krex.evaluate.guard`` (what a candidate
may not touch during one evaluation).  Mutation inside kept objects (a list
in a module) and native code are out of reach.
"""

from __future__ import annotations

import sys
import types
from typing import Any

Key = tuple[str, ...]  # (module, attribute) or (module, class, attribute)
_WRAPPERS = (staticmethod, classmethod, types.MethodType)  # identities of their __func__


def fingerprint(module_names: list[str]) -> dict[Key, Any]:
    """``{(module, attr): identity}`` for every binding of the named modules (and of the
    classes they define); :func:`changes` names what differs.  Taken over thousands of
    bindings: kept to one dict store and one :func:`_identity` each."""
    out: dict[Key, Any] = {}
    for name in module_names:
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            out[name, attr] = _identity(value)
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                for cattr, cvalue in list(vars(value).items()):
                    out[name, attr, cattr] = _identity(cvalue)
    return out


def _identity(value: Any) -> Any:
    if isinstance(value, _WRAPPERS):  # methods, classmethods, staticmethods
        value = value.__func__
    if type(value) is types.FunctionType:
        return (id(value), id(value.__code__), id(value.__defaults__), id(value.__kwdefaults__))
    return id(value)


def changes(before: dict[Key, Any], after: dict[Key, Any]) -> list[str]:
    """Names rebound, replaced or removed since ``before`` (new names are not judged)."""
    if before.items() <= after.items():  # the usual answer, at C speed
        return []
    return sorted(".".join(k) for k, v in before.items() if after.get(k) != v)


def krex_modules() -> list[str]:
    """krex's own modules, as loaded now."""
    return sorted(n for n in list(sys.modules) if n == "krex" or n.startswith("krex."))
