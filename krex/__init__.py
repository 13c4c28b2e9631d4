"""krex: concurrent kernel benchmarking on shared GPUs.

A benchmarking command marks its timing-critical regions; inside a region it
has the device to itself, everything else runs concurrently.  The map of the
code is docs/architecture.md.
"""

from krex.errors import KrexError

__version__ = "0.1.0"

__all__ = ["KrexError", "__version__"]
