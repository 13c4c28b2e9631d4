"""krex: concurrent kernel benchmarking on shared GPUs.

A benchmarking command marks its timing-critical regions; inside a region it
has the device to itself, everything else runs concurrently.  The map of the
code is docs/architecture.md.

``krex.measure`` is both the package of the timing helpers and, called, the
function ``krex.measure(fn, ...)`` (the package is callable).
"""

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

__all__ = [
    "BenchWarning",
    "Client",
    "Comparison",
    "KrexError",
    "MeasureWarning",
    "Measurement",
    "Region",
    "RegionReport",
    "__version__",
    "bench",
    "compare",
    "measure",
    "region",
]
