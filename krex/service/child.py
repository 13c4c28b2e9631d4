"""A job's work in a process of its own (evaluate, bench): what a cancel can kill.

In: ``python -m krex.service.child`` with the job (``kind``, ``tenant``,
``request``, ``records``) as JSON on stdin, started by :mod:`krex.service.work`
in the job's own folder, in a session of its own, with ``KREX_TENANT`` set.
Out: ``result.json`` in that folder — ``{"result": ...}`` or ``{"error":
{"code", "message", "fields"}}`` — written atomically once the work is done,
so a child killed before it finished leaves nothing a job could take for a
result (and an evaluation killed before it ended stores no record).

The work runs as the job's tenant: an evaluation's programs carry it to the
daemon (:data:`krex.client.connection.ACTING_FOR`), a bench's region and
ad-hoc job are charged to it (``KREX_TENANT``, read by :mod:`krex.client.region`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

RESULT_NAME = "result.json"


def evaluate(request: dict[str, Any], tenant: str, records: str | None) -> dict[str, Any]:
    from krex.evaluate.pipeline import evaluate
    from krex.service import summary

    opts = {k: request[k] for k in ("device", "seeds", "shapes", "atol", "rtol", "cache",
                                    "timeout_s", "fresh") if request.get(k) is not None}
    ev = evaluate(request["reference"], request["candidate"], request["inputs"],
                  records=records, label=f"tenant:{tenant}", **opts)
    return summary.evaluation(ev.to_dict())


def bench(request: dict[str, Any], tenant: str, records: str | None) -> dict[str, Any]:
    from krex.measure.command import bench_command
    from krex.service import summary

    r = request
    result = bench_command(r["command"], warmup_runs=r.get("warmup", 1), runs=r.get("runs"),
                           device=r.get("device"), budget_s=r.get("budget_s", 1.0),
                           timeout_s=r.get("timeout_s"), shell=r.get("shell", "sh"),
                           label=f"tenant:{tenant}")
    return summary.bench(result)


KINDS = {"evaluate": evaluate, "bench": bench}


def run(job: dict[str, Any]) -> dict[str, Any]:
    """``{"result": ...}`` or ``{"error": ...}`` of one job, run as its tenant."""
    from krex.client.connection import ACTING_FOR
    from krex.errors import KrexError

    ACTING_FOR.set(job["tenant"])
    try:
        return {"result": KINDS[job["kind"]](job["request"], job["tenant"], job.get("records"))}
    except KrexError as exc:
        return {"error": {"code": exc.code, "message": exc.message, "fields": exc.fields()}}


def write(out: dict[str, Any], folder: str) -> None:
    tmp = os.path.join(folder, RESULT_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(out, f, default=str)
    os.replace(tmp, os.path.join(folder, RESULT_NAME))


def main() -> int:
    job = json.load(sys.stdin)
    write(run(job), os.getcwd())
    return 0


if __name__ == "__main__":
    sys.exit(main())
