"""krex: concurrent kernel benchmarking on shared GPUs.

A benchmarking command marks its timing-critical regions; inside a region it
has the device to itself, everything else runs concurrently.  The map of the
code is docs/architecture.md.

``krex.measure`` is both the package of the timing helpers and, called, the
function ``krex.measure(fn, ...)`` (the package is callable).
"""

from krex.lazy import lazy_exports
from krex.version import __version__

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (CLI start-up)
if TYPE_CHECKING:  # imported on first use: `import krex` (and the CLI) stays cheap
    from krex import measure
    from krex.client import Client, Region, region, regions
    from krex.errors import KrexError
    from krex.evaluate import Evaluation, evaluate
    from krex.measure import (
        BenchWarning,
        Comparison,
        Measurement,
        MeasureWarning,
        bench,
        compare,
    )
    from krex.protocol.report import RegionReport

__getattr__, __dir__ = lazy_exports(__name__, {
    "measure": "krex.measure",
    # From their modules, not the krex.client package: once the submodule
    # krex.client.region is imported, the package's attribute `region` is that module.
    "Client": "krex.client.connection:Client",
    **{n: f"krex.client.region:{n}" for n in ("Region", "region", "regions")},
    "KrexError": "krex.errors:KrexError",
    **{n: f"krex.evaluate:{n}" for n in ("evaluate", "Evaluation")},
    **{n: f"krex.measure:{n}" for n in ("BenchWarning", "Comparison", "Measurement",
                                         "MeasureWarning", "bench", "compare")},
    "RegionReport": "krex.protocol.report:RegionReport",
})

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
    "regions",
]
