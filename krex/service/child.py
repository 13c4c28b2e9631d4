"""A job's work in a process of its own (evaluate, bench): what a cancel can kill.

In: ``python -m krex.service.child``, started by :mod:`krex.service.work` in a
session of its own ahead of its job (a spare: its imports are done before the
job comes), then the job (``kind``, ``tenant``, ``request``, ``records``,
``folder``, ``work``, ``run_as``) as JSON on stdin; it moves into ``work``, sets
``KREX_TENANT`` and sends its output to ``child.log`` there (its temporary files go
under ``tmp/`` there too).  A spare whose
stdin closes (the service stopped) exits.  Out: ``result.json`` in that
folder — ``{"result": ...}`` or ``{"error": {"code", "message", "fields"}}`` —
written atomically once the work is done,
so a child killed before it finished leaves nothing a job could take for a
result (and an evaluation killed before it ended stores no record).

The work runs as the job's tenant: an evaluation's programs carry it to the
daemon (:data:`krex.client.connection.ACTING_FOR`), a bench's region and
ad-hoc job are charged to it (``KREX_TENANT``, read by :mod:`krex.client.region`),
and a bench's commands run as ``run_as`` (the tenant's user on a root node).
This process stays the service's user: it writes the job's result and record.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from krex import resultfile

RESULT_NAME = "result.json"
LOG_NAME = "child.log"


def evaluate(job: dict[str, Any]) -> dict[str, Any]:
    from krex.evaluate.pipeline import evaluate
    from krex.service import summary

    request, tenant, records = job["request"], job["tenant"], job.get("records")
    opts = {k: request[k] for k in ("device", "seeds", "shapes", "atol", "rtol", "cache",
                                    "timeout_s", "fresh") if request.get(k) is not None}
    ev = evaluate(request["reference"], request["candidate"], request["inputs"],
                  records=records, label=f"tenant:{tenant}", **opts)
    return summary.evaluation(ev.to_dict())


def bench(job: dict[str, Any]) -> dict[str, Any]:
    from krex.measure.command import bench_command
    from krex.protocol.runas import RunAs
    from krex.service import summary

    r = job["request"]
    result = bench_command(r["command"], warmup_runs=r.get("warmup", 1), runs=r.get("runs"),
                           device=r.get("device"), budget_s=r.get("budget_s", 1.0),
                           timeout_s=r.get("timeout_s"), shell=r.get("shell", "sh"),
                           label=f"tenant:{job['tenant']}",
                           run_as=RunAs.from_dict(job.get("run_as")))
    return summary.bench(result)


KINDS = {"evaluate": evaluate, "bench": bench}


def run(job: dict[str, Any]) -> dict[str, Any]:
    """``{"result": ...}`` or ``{"error": ...}`` of one job, run as its tenant."""
    from krex.client.connection import ACTING_FOR
    from krex.errors import KrexError

    ACTING_FOR.set(job["tenant"])
    try:
        return {"result": KINDS[job["kind"]](job)}
    except KrexError as exc:
        return {"error": {"code": exc.code, "message": exc.message, "fields": exc.fields()}}


def write(out: dict[str, Any], folder: str) -> None:
    resultfile.write(os.path.join(folder, RESULT_NAME), out, indent=None, default=str)


def _warm() -> None:
    """Import what the jobs use before the job comes (a spare waits warm)."""
    import krex.client.connection
    import krex.client.region
    import krex.evaluate.pipeline
    import krex.measure.command
    import krex.service.summary  # noqa: F401  (imported to be warm)


def _enter(job: dict[str, Any]) -> None:
    """Become the job's process: its code's working directory, its tenant, its log, and
    its temporary files in the folder (an evaluation's working directory and kept copies
    go with the folder when the service removes it, even when a cancel killed this
    process mid-way).  The folder is the service's: the job's user may enter ``tmp/``
    (to reach what it is given there), not list it."""
    import tempfile

    folder = job["folder"]
    scratch = os.path.join(folder, "tmp")
    os.mkdir(scratch, 0o700)
    if job.get("run_as"):
        os.chown(scratch, -1, job["run_as"]["gid"])
        os.chmod(scratch, 0o710)
    tempfile.tempdir = scratch  # this process's own: the commands it runs keep TMPDIR
    os.environ["KREX_TENANT"] = job["tenant"]
    os.chdir(job.get("work") or folder)  # where a bench's commands and a program run
    fd = os.open(os.path.join(folder, LOG_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> int:
    _warm()
    try:
        job = json.load(sys.stdin)
    except ValueError:  # stdin closed: the service stopped before it needed this spare
        return 0
    _enter(job)
    write(run(job), job["folder"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
