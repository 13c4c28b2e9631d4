"""daemon: the node daemon (``krex serve``) — who holds which device, and the evidence.

In: connections on the owner-only Unix socket (``server``), each peer known by
``SO_PEERCRED`` and its start time; typed requests (:mod:`krex.protocol`):
jobs to create, attach and end, regions to acquire and release, programs to
run in warm workers, status.  Out: replies and pushed grants, revocations and
program output; for every region a :class:`~krex.protocol.report.RegionReport`
(on release, and the short records of ``regions``); enforcement applied and
undone on real processes through :mod:`krex.enforce`; a JSONL event log.

Inside: ``core`` holds all state under one lock and asks the pure
``scheduler`` who is next; ``exclusivity`` turns a grant into gate → drain →
freeze → isolate and back; ``jobs`` knows which process belongs to which
job; ``pools`` keeps warm workers per device (each a job); ``config`` is
``DaemonConfig`` (its field metadata makes the ``krex serve`` flags);
``eventlog`` writes events off the grant path.  The daemon never imports the
client.  Map: docs/architecture.md.
"""
