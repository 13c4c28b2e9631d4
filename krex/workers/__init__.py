"""workers: the persistent context pool (DESIGN.md, mechanism 4).

In: a ``PoolSpec`` per device, then ``ExecRequest``s (a script path with argv,
cwd and environment, or a pickled callable).  Out: live ``(stream, text)``
output through a callback and one ``ExecResult`` per request: status, exit
code, remote traceback, the callable's value, the worker's pid and whether
(and why) the worker was recycled.

Inside: ``pool`` (sizing, queueing, recycling) drives ``process`` (one
spawned worker, its channel and output pipes) through ``execution`` (one
program, seen from the pool).  The worker itself (``worker``, run as
``python -m krex.workers.worker``) opens the device ``context`` once, runs
programs with ``runner``, puts process state back with ``snapshot`` and
judges its own fitness with ``canary``.  See docs/workers.md.
"""

from typing import TYPE_CHECKING

from krex.lazy import lazy_exports

if TYPE_CHECKING:
    from krex.workers.launcher import DefaultLauncher, WorkerLauncher
    from krex.workers.pool import WorkerPool
    from krex.workers.spec import ExecRequest, ExecResult, PoolSpec

# Lazy: the client imports krex.workers.spec, and must not pay for the pool.
__getattr__, __dir__ = lazy_exports(__name__, {
    "DefaultLauncher": "krex.workers.launcher:DefaultLauncher",
    "WorkerLauncher": "krex.workers.launcher:WorkerLauncher",
    "WorkerPool": "krex.workers.pool:WorkerPool",
    **{n: f"krex.workers.spec:{n}" for n in ("ExecRequest", "ExecResult", "PoolSpec")}})

__all__ = ["DefaultLauncher", "ExecRequest", "ExecResult", "PoolSpec", "WorkerLauncher",
           "WorkerPool"]
