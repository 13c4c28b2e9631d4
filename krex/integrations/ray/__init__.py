"""krex on a Ray cluster (extra ``ray``; also importable as ``krex.ray``).

In: Python benchmarking programs (paths) submitted from any Ray driver.  Out:
Ray ObjectRefs of JSON-able result dicts — the worker's ``ExecResult`` plus the
node, the daemon, captured output, what the program :func:`emit`-ted, the
daemon's records of its regions and timings.

Each Ray node that offers krex runs one long-lived node actor
(:mod:`~krex.integrations.ray.node`) pinned to it, which starts or attaches to
that node's krex daemon: warm workers, regions and enforcement are exactly as
on one node.  A per-driver dispatcher (:mod:`~krex.integrations.ray.dispatch`)
routes programs to the least loaded node offering their device, as actor calls
(never Ray tasks: a fresh process per program would mean cold contexts).  A node
or daemon lost mid-program gives ``status == "lost"`` (unknown outcome), not a
silent retry.  Set-up and numbers: docs/cluster.md.  ``import krex.ray`` does not
import Ray; the functions do.
"""

from krex.errors import NoKrexNodes, RayMissing
from krex.integrations.ray.nodes import connect, node_actors, start
from krex.integrations.ray.program import emit
from krex.integrations.ray.resources import node_resources, resources_json
from krex.integrations.ray.submission import map, regions, shutdown, status, submit

__all__ = [
    "NoKrexNodes",
    "RayMissing",
    "connect",
    "emit",
    "map",
    "node_actors",
    "node_resources",
    "regions",
    "resources_json",
    "shutdown",
    "start",
    "status",
    "submit",
]
