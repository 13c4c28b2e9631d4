"""evaluate: the agent's one call — is the candidate correct, faster, and can I trust that?

In: a reference and a candidate (callables or ``"path.py:function"``), an
inputs builder (``make(seed)`` or ``make(seed, shape)``), a device and
options.  Out: an :class:`Evaluation` — verdict (faster / slower / same /
unclear / invalid), speedup with its interval, correctness, named
:class:`Finding` objects with evidence, provenance — stored in the records
database (``krex.records``).

A pure pipeline over ``workers`` and ``measure`` (no transport code):
``pipeline`` plans the cases and runs one program in a warm worker.  On ``cpu``
(``isolation="process"``) that program is ``sealed.run_sealed``, a trusted driver
that runs the reference and the candidate each in a ``callee`` process of its own
through the native dispatcher (``dispatch``, ``callees``, ``timing``,
``accounting``; judged by ``isolation``; read back by ``evidence``, no pickle).
With ``isolation="worker"`` (devices) it is
``worker.run_candidate`` (the reference's outputs, announced before the
candidate is imported, then correctness,
identity probe, ``krex.compare`` with input rotation and the counters of
``probe``/``counters``, the tamper check of ``guard``) — then ``judge``
decides in this process from what came back (``values``: trees, files,
tolerant comparison).  ``readings`` is the one place results of
``krex.measure`` are read.  See docs/evaluate.md.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from krex.evaluate.findings import Code, Finding
from krex.evaluate.result import Evaluation


def evaluate(*args: Any, **kwargs: Any) -> Evaluation:
    """``krex.evaluate(reference, candidate, inputs, *, device=None, ...)``: see pipeline."""
    from krex.evaluate.pipeline import evaluate as run

    return run(*args, **kwargs)



class _CallableModule(types.ModuleType):
    """``krex.evaluate`` is this package *and* the function: importing a submodule
    (``krex.evaluate.worker``) rebinds the attribute ``krex.evaluate`` to the
    package, so the package itself must be callable."""

    def __call__(self, *args: Any, **kwargs: Any) -> Evaluation:
        return evaluate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["Code", "Evaluation", "Finding", "evaluate"]
