"""krex: concurrent kernel benchmarking on shared GPUs.

A benchmarking command marks its timing-critical regions; inside a region it
has the device to itself, everything else runs concurrently.  The map of the
code is docs/architecture.md.
"""

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # imported on first use: the CLI's start-up path stays as it was
    from krex.evaluate import Evaluation, evaluate

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("evaluate", "Evaluation"):
        value = getattr(importlib.import_module("krex.evaluate"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'krex' has no attribute {name!r}")


__all__ = [
    "Client",
    "Comparison",
    "Evaluation",
    "KrexError",
    "KrexMeasurementWarning",
    "MeasureWarning",
    "Measurement",
    "Region",
    "__version__",
    "bench",
    "compare",
    "evaluate",
    "measure",
    "region",
]
