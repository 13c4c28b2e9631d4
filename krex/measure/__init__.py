"""measure: timing you can trust — ``bench``, ``measure``, ``compare``, ``bench_command``.

What comes in: a zero-argument callable (a kernel launch, a Python
function) or a command line, and a device string ("cpu", "cuda:0",
"rocm:0", "fakegpu:0").  What goes out: milliseconds (``bench``, the exact
contract of ``triton.testing.do_bench``), a :class:`Measurement` (samples,
statistics, the region report, warnings with next actions), a
:class:`Comparison` (A/B speedup with an interval and a verdict), or a
hyperfine-style dict for a command.

Method (docs/measure.md): first call, estimate and warm-up run outside the
region; only the timed loop holds the region; cache flushed between samples
(``cache="cold"``); noise-based stopping; clocks checked; samples checked
against the region's hold time; a region that is not clean is retried.

Modules: ``stats`` and ``stopping`` (pure logic), ``timers`` and ``events``
(replaceable clocks), ``cache``, ``clocks``, ``regions`` (injectable region
factory), ``checks`` (warnings), ``options`` (what the calls share), ``loop``
(sampling), ``bench``, ``compare``, ``command``, ``graphs`` (CUDA graphs),
``result``.  The package itself is callable: ``krex.measure(fn)`` is
:func:`measure`.
"""

import sys
import types
from typing import Any

from krex.errors import CommandFailed
from krex.measure.bench import BenchCostHint, BenchWarning, bench, measure
from krex.measure.checks import MeasureWarning
from krex.measure.command import bench_command
from krex.measure.compare import compare
from krex.measure.regions import LocalRegion, ScriptedRegions, set_region_factory
from krex.measure.result import Comparison, Measurement
from krex.measure.timers import CpuTimer, FakeTimer, Timer, make_timer

__all__ = [
    "BenchCostHint",
    "BenchWarning",
    "CommandFailed",
    "Comparison",
    "CpuTimer",
    "FakeTimer",
    "LocalRegion",
    "MeasureWarning",
    "Measurement",
    "ScriptedRegions",
    "Timer",
    "bench",
    "bench_command",
    "compare",
    "make_timer",
    "measure",
    "set_region_factory",
]


class _MeasurePackage(types.ModuleType):
    """``krex.measure`` is this package *and*, called, the function :func:`measure`.

    ``krex.measure(fn, device="cuda:0")`` is public API; so are the package's
    modules (``krex.measure.stats``).  A function bound to the name in
    ``krex/__init__.py`` used to hide the package (``krex.measure.stats`` raised
    ``AttributeError``); making the package callable keeps both, and renames
    nothing other code imports.
    """

    def __call__(self, fn: Any, **kwargs: Any) -> Measurement:
        return measure(fn, **kwargs)


sys.modules[__name__].__class__ = _MeasurePackage
_MeasurePackage.__call__.__doc__ = measure.__doc__
