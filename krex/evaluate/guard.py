"""Has the candidate touched what krex's numbers rest on?  Fingerprints of trusted modules.

Taken in the candidate's worker before the candidate is imported and again
after the timing: every binding in the namespaces of krex's own modules, the
clocks (``time``), ``math``, ``statistics``, ``random``, ``ctypes``,
``hashlib``, numpy's and torch's top level, and the reference's and inputs
builder's modules — plus, for each function and class found there, the
identity of its code object, defaults and class attributes.  Rebinding
``time.perf_counter``, replacing ``krex.measure.stats.median`` or swapping a
method's ``__code__`` all change the fingerprint.  Taking it and checking it
run at C speed and compare identities, never equality
(:class:`krex.workers.fingerprint.Bindings`).  Mutation inside kept objects
(a list in a module) and native code are out of reach: see the threat model
in docs/evaluate.md.
"""

from __future__ import annotations

import sys

from krex.workers.fingerprint import Bindings, fingerprint, krex_modules

__all__ = ["TRUSTED", "Bindings", "Guard", "fingerprint", "guard", "trusted_modules"]

TRUSTED = ("time", "math", "statistics", "random", "ctypes", "hashlib", "gc", "numpy",
           "numpy.linalg", "numpy.random", "torch", "torch.cuda", "torch.nn.functional")


def trusted_modules(extra: tuple[str, ...] = ()) -> list[str]:
    return sorted({*krex_modules(), *(n for n in (*TRUSTED, *extra) if n in sys.modules)})


class Guard:
    """What :meth:`changed` judges: the trusted modules' bindings since this was made.
    krex's modules that the worker's canary snapshot holds are checked against that
    snapshot (taken when the worker started, checked after every program — so a change
    it sees was made since); the rest are snapshotted here.  Made where the worker's
    snapshot already differs (before the candidate exists), everything is snapshotted
    anew."""

    def __init__(self, module_names: list[str]) -> None:
        from krex.workers.canary import worker_krex

        base = worker_krex()
        if base is not None and base.changed():
            base = None  # changed before this evaluation: not this candidate's doing
        held = set(base.modules) if base is not None else set()
        self.parts = [b for b in (base, Bindings([n for n in module_names if n not in held]))
                      if b is not None]

    def changed(self) -> list[str]:
        return sorted({name for b in self.parts for name in b.changed()})

    def __len__(self) -> int:
        return sum(len(b) for b in self.parts)


def guard(module_names: list[str]) -> Guard:
    """A :class:`Guard` over ``module_names`` (:func:`trusted_modules`)."""
    return Guard(module_names)
