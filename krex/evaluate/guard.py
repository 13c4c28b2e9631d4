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
    it sees was made since); the other TRUSTED and krex modules against this process's
    own snapshots from earlier evaluations when unchanged since (else taken anew); the
    rest (the reference's and the inputs builder's modules) are snapshotted here.  Made
    where the worker's snapshot already differs (before the candidate exists), krex's
    modules are snapshotted anew too."""

    def __init__(self, module_names: list[str]) -> None:
        from krex.workers.canary import worker_krex

        base = worker_krex()
        if base is not None and base.changed():
            base = None  # changed before this evaluation: not this candidate's doing
        held = set(base.modules) if base is not None else set()
        rest = [n for n in module_names if n not in held]
        self.parts = [base] if base is not None else []
        self.parts += [_kept(n) for n in rest if _keepable(n)]
        self.parts.append(Bindings([n for n in rest if not _keepable(n)]))

    def changed(self) -> list[str]:
        return sorted({name for b in self.parts for name in b.changed()})

    def __len__(self) -> int:
        return sum(len(b) for b in self.parts)


_KEPT: dict[str, Bindings] = {}  # this process's snapshots of TRUSTED and krex modules


def _keepable(name: str) -> bool:
    """A module whose snapshot may serve later evaluations in this process: the fixed
    TRUSTED list and krex's own (a bounded set; the reference's and the inputs builder's
    modules are loaded anew by every program)."""
    return name in TRUSTED or name == "krex" or name.startswith("krex.")


def _kept(name: str) -> Bindings:
    """``name``'s snapshot as taken by an earlier evaluation when its module is still the
    same object and nothing in it changed since — the same identities a new snapshot
    would hold — else a new one."""
    kept = _KEPT.get(name)
    module = sys.modules.get(name)
    if kept is None or module is None or not kept.spaces \
            or kept.spaces[0][1] is not vars(module) or kept.changed():
        kept = _KEPT[name] = Bindings([name])
    return kept


def guard(module_names: list[str]) -> Guard:
    """A :class:`Guard` over ``module_names`` (:func:`trusted_modules`)."""
    return Guard(module_names)
