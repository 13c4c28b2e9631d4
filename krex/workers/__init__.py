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

from krex.workers.launcher import DefaultLauncher, WorkerLauncher
from krex.workers.pool import WorkerPool
from krex.workers.spec import ExecRequest, ExecResult, PoolSpec

__all__ = ["DefaultLauncher", "ExecRequest", "ExecResult", "PoolSpec", "WorkerLauncher",
           "WorkerPool"]
