"""The client side: connections, regions, managed jobs.

In: calls from user code (``krex.region()``) and the CLI.  Out: protocol
requests to the node daemon, which the client starts itself when none is
running (the zero-setup default).
"""

from krex.client.connection import Client, Connection
from krex.client.region import Region, region

__all__ = ["Client", "Connection", "Region", "region"]
