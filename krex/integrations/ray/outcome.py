"""The result dict of one program run on a cluster (JSON-able).

In: the worker's :class:`~krex.workers.spec.ExecResult` and what the node saw,
or the news that a node or its daemon was lost.  Out: one dict with the
program's status, output, returned data, region records and timings, always
naming the node.  ``status == "lost"`` means *unknown outcome*: the program may
or may not have run to the end; it is never retried unless the caller asked.
"""

from __future__ import annotations

import time
from typing import Any

from krex.integrations.ray.program import Program
from krex.workers.spec import ExecResult

LOST = "lost"


def base(program: Program, node_id: str | None) -> dict[str, Any]:
    return {"program": program.name, "program_id": program.program_id, "args": program.args,
            "device": program.device, "node_id": node_id, "daemon_pid": None,
            "stdout": "", "stderr": "", "returned": None, "regions": [], "lost": None,
            "attempts": [], "timings": {"submitted_wall_s": program.submitted_wall_s}}


def finished(program: Program, node: dict[str, Any], result: ExecResult,
             output: dict[str, str], extra: dict[str, Any]) -> dict[str, Any]:
    out = base(program, node["node_id"])
    out.update(result.to_dict())
    out.update(output)
    out.update(extra)
    out["ok"] = result.ok
    out["daemon_pid"] = node.get("daemon_pid")
    out["node_ip"] = node.get("node_ip")
    return out


def lost(program: Program, node_id: str | None, what: str, reason: str,
         **fields: Any) -> dict[str, Any]:
    """A program whose node (``what="node"``) or daemon (``"daemon"``) went away."""
    out = base(program, node_id)
    out.update({"status": LOST, "ok": False, "exit_code": None, "outcome": "unknown",
                "exception": f"{what} lost: {reason}",
                "lost": {"what": what, "node_id": node_id, "reason": reason}})
    out.update(fields)
    out["timings"]["lost_wall_s"] = time.time()
    return out


def unschedulable(program: Program, reason: str) -> dict[str, Any]:
    """No node offers the program's device (or every such node was lost)."""
    out = base(program, None)
    out.update({"status": "unschedulable", "ok": False, "exit_code": None,
                "exception": reason})
    return out


def rejected(program: Program, node_id: str | None, exc: Exception) -> dict[str, Any]:
    """The node's daemon refused the program (unknown device, shutting down, ...)."""
    out = base(program, node_id)
    code = getattr(exc, "code", type(exc).__name__)
    out.update({"status": "rejected", "ok": False, "exit_code": None,
                "exception": f"{code}: {exc}", "hint": getattr(exc, "hint", None)})
    return out
