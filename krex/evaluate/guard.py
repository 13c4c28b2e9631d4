"""Has the candidate touched what krex's numbers rest on?  Fingerprints of trusted modules.

Taken in the candidate's worker before the candidate is imported and again
after the timing: every binding in the namespaces of krex's own modules, the
clocks (``time``), ``math``, ``statistics``, ``random``, ``ctypes``,
``hashlib``, numpy's and torch's top level, and the reference's and inputs
builder's modules — plus, for each function and class found there, the
identity of its code object, defaults and class attributes.  Rebinding
``time.perf_counter``, replacing ``krex.measure.stats.median`` or swapping a
method's ``__code__`` all change the fingerprint.  Mutation inside kept
objects (a list in a module) and native code are out of reach: see the
threat model in docs/evaluate.md.
"""

from __future__ import annotations

import sys
import types
from typing import Any

TRUSTED = ("time", "math", "statistics", "random", "ctypes", "hashlib", "gc", "numpy",
           "numpy.linalg", "numpy.random", "torch", "torch.cuda", "torch.nn.functional")


def trusted_modules(extra: tuple[str, ...] = ()) -> list[str]:
    names = [n for n in list(sys.modules) if n == "krex" or n.startswith("krex.")]
    return sorted({*names, *(n for n in (*TRUSTED, *extra) if n in sys.modules)})


Key = tuple[str, ...]  # (module, attribute) or (module, class, attribute)
_WRAPPERS = (staticmethod, classmethod, types.MethodType)  # identities of their __func__


def fingerprint(module_names: list[str]) -> dict[Key, Any]:
    """``{(module, attr): identity}`` for every binding of the named modules (and of the
    classes they define); :func:`changes` names what differs.  Taken twice per evaluation
    over thousands of bindings: kept to one dict store and one :func:`_identity` each."""
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
    return sorted(".".join(k) for k, v in before.items() if after.get(k) != v)
