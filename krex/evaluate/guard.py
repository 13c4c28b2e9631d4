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

__all__ = ["TRUSTED", "Bindings", "fingerprint", "trusted_modules"]

TRUSTED = ("time", "math", "statistics", "random", "ctypes", "hashlib", "gc", "numpy",
           "numpy.linalg", "numpy.random", "torch", "torch.cuda", "torch.nn.functional")


def trusted_modules(extra: tuple[str, ...] = ()) -> list[str]:
    return sorted({*krex_modules(), *(n for n in (*TRUSTED, *extra) if n in sys.modules)})
