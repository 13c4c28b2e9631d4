"""eval: the headline experiment — throughput and timing fidelity, side by side.

What comes in: a device (``cpu``, ``fakegpu:0``), a number of agents and of
commands per agent, the modes to compare (``none``, ``command``,
``function``, ``region`` and its ablations) and a workload profile (phase
sizes).  What goes out: a versioned results file (JSON, written atomically),
a markdown table and PNG plots made from that file: throughput per mode and
its speedup against ``command`` beside the ideal bound, and timing inflation
(measured ÷ the same kernel alone) as p50/p95/p99 per kernel-duration bucket.

Modules: ``profile`` (phase sizes), ``compile`` / ``kernels`` / ``heavy`` /
``program`` (one benchmarking command), ``modes``, ``daemon`` / ``serve``
(a private daemon per block), ``launch`` (a command in a mode), ``runner``
(interleaved blocks and references), ``metrics``, ``bound``, ``results``,
``plots``, ``experiment`` (end to end).  Method: docs/eval.md.
"""

from krex.eval.experiment import evaluate, report
from krex.eval.modes import MODES, parse_modes
from krex.eval.profile import DEFAULT, QUICK, Profile
from krex.eval.runner import EvalConfig

__all__ = ["DEFAULT", "MODES", "QUICK", "EvalConfig", "Profile", "evaluate", "parse_modes",
           "report"]
