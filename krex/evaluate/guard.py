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


def fingerprint(module_names: list[str]) -> dict[str, tuple[int, ...]]:
    """``{"module.attr": identities}`` for every binding of the named modules."""
    out: dict[str, tuple[int, ...]] = {}
    for name in module_names:
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            out[f"{name}.{attr}"] = _identity(value)
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                for cattr, cvalue in list(vars(value).items()):
                    out[f"{name}.{attr}.{cattr}"] = _identity(cvalue)
    return out


def _identity(value: Any) -> tuple[int, ...]:
    fn = getattr(value, "__func__", value)  # methods, classmethods, staticmethods
    if isinstance(fn, types.FunctionType):
        return (id(fn), id(fn.__code__), id(fn.__defaults__), id(fn.__kwdefaults__))
    return (id(value),)


def changes(before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]]) -> list[str]:
    """Names rebound, replaced or removed since ``before`` (new names are not judged)."""
    return sorted(k for k, v in before.items() if after.get(k) != v)
