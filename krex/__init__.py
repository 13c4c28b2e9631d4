"""krex: concurrent kernel benchmarking on shared GPUs.

A benchmarking command marks its timing-critical regions; inside a region it
has the device to itself, everything else runs concurrently.  The map of the
code is docs/architecture.md.

``krex.measure`` is both the package of the timing helpers and, called, the
function ``krex.measure(fn, ...)`` (the package is callable).
"""

import importlib
from typing import TYPE_CHECKING, Any

from krex import measure
from krex.client import Client, Region, region
from krex.errors import KrexError
from krex.measure import (
    BenchWarning,
    Comparison,
    Measurement,
    MeasureWarning,
    bench,
    compare,
)
from krex.protocol.report import RegionReport
from krex.version import __version__

if TYPE_CHECKING:  # imported on first use: the CLI's start-up path stays as it was
    from krex.evaluate import Evaluation, evaluate


def __getattr__(name: str) -> Any:
    if name in ("evaluate", "Evaluation"):
        value = getattr(importlib.import_module("krex.evaluate"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'krex' has no attribute {name!r}")


__all__ = [
    "BenchWarning",
    "Client",
    "Comparison",
    "Evaluation",
    "KrexError",
    "MeasureWarning",
    "Measurement",
    "Region",
    "RegionReport",
    "__version__",
    "bench",
    "compare",
    "evaluate",
    "measure",
    "region",
]
