"""eval: the headline experiment — throughput and timing fidelity, side by side.

What comes in: a device (``cpu``, ``fakegpu:0``), a number of agents and of
commands per agent, the modes to compare (``none``, ``command``,
``function``, ``region`` and its ablations) and a workload profile (phase
sizes).  What goes out: a versioned results file (JSON, written atomically),
a markdown table and PNG plots made from that file: throughput per mode and
its speedup against ``command`` beside the ideal bound, and timing inflation
(measured ÷ the same kernel alone) as p50/p95/p99 per kernel-duration bucket.

Modules: ``profile`` (phase sizes), ``compile`` / ``kernels`` / ``heavy`` /
``program`` (one benchmarking command), ``modes``, ``daemon`` (a private
daemon per block), ``launch`` (a command in a mode), ``runner``
(interleaved blocks and references), ``metrics``, ``bound``, ``results``,
``plots``, ``experiment`` (end to end).  Method: docs/eval.md.

The names below are imported lazily: the benchmarking command itself
(``program.py``) imports ``krex.eval.heavy`` and must not pay for the harness.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"evaluate": "experiment", "report": "experiment", "MODES": "modes",
          "parse_modes": "modes", "DEFAULT": "profile", "QUICK": "profile",
          "Profile": "profile", "EvalConfig": "runner"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'krex.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(f"krex.eval.{_WHERE[name]}"), name)
