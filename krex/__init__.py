"""krex: concurrent kernel benchmarking on shared GPUs.

A benchmarking command marks its timing-critical regions; inside a region it
has the device to itself, everything else runs concurrently.  The map of the
code is docs/architecture.md.
"""

from krex.client import Client, Region, region
from krex.errors import KrexError
from krex.measure import (
    Comparison,
    KrexMeasurementWarning,
    Measurement,
    MeasureWarning,
    bench,
    compare,
    measure,
)
from krex.protocol.report import RegionReport

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Comparison",
    "KrexError",
    "KrexMeasurementWarning",
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
