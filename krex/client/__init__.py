"""The client side: connections, regions, managed jobs.

In: calls from user code (``krex.region()``) and the CLI.  Out: protocol
requests to the node daemon, which the client starts itself when none is
running (the zero-setup default).
"""

from typing import TYPE_CHECKING

from krex.lazy import lazy_exports

if TYPE_CHECKING:
    from krex.client.connection import Client, Connection
    from krex.client.region import Region, region, regions

# Lazy (krex exec imports the connection only).  Caveat of a lazy package: once the
# submodule krex.client.region is imported, ``krex.client.region`` is that module (as for
# any submodule); ``krex.region`` and ``krex.client.region.region`` are the function.
__getattr__, __dir__ = lazy_exports(__name__, {
    "Client": "krex.client.connection:Client", "Connection": "krex.client.connection:Connection",
    "Region": "krex.client.region:Region", "region": "krex.client.region:region",
    "regions": "krex.client.region:regions"})

__all__ = ["Client", "Connection", "Region", "region", "regions"]
