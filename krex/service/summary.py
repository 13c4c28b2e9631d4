"""Results an agent can read: the few fields that decide what to do next.

An evaluation becomes verdict, speedup and interval, correctness, findings
(code, severity, message, next action), p50/p95 and noise of each side, the
region's cleanliness and the record id; a bench becomes p50/p95, noise, runs
and its region; an exec its exit code and the tail of its output.
"""

from __future__ import annotations

from typing import Any

from krex.evaluate.result import pooling


def evaluation(ev: dict[str, Any]) -> dict[str, Any]:
    timing = ev.get("timing") or {}
    region = timing.get("region") or {}
    return {
        "record_id": ev.get("id"), "verdict": ev.get("verdict"), "correct": ev.get("correct"),
        "speedup": ev.get("speedup"), "ci_low": ev.get("ci_low"), "ci_high": ev.get("ci_high"),
        "status": ev.get("status"), "reused": ev.get("reused", False),
        "findings": [{k: f.get(k) for k in ("code", "severity", "message", "next_action")}
                     for f in ev.get("findings", [])],
        "reference": _side(timing.get("reference")), "candidate": _side(timing.get("candidate")),
        "pairs": timing.get("pairs"), **pooling(ev), "region_clean": region.get("clean"),
        "region_id": region.get("region"), "device": ev.get("device"),
        "output_tail": (ev.get("output_tail") or "")[-2000:],
    }


def _side(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    if not summary:
        return None
    return {"p50_ms": summary.get("median_ms"), "p95_ms": summary.get("p95_ms"),
            "noise_rel": summary.get("noise_rel")}


def bench(result: dict[str, Any]) -> dict[str, Any]:
    from krex.measure.command import readings

    region = result.get("region") or {}
    return {
        "command": result.get("command"), "runs": result.get("runs"),
        **readings(result.get("times_s", [])),
        "mean_ms": (result.get("mean_s") or 0) * 1e3,
        "exit_codes": result.get("exit_codes"), "region_clean": region.get("clean"),
        "region_id": region.get("region"), "waited_s": region.get("waited_s"),
        "held_s": region.get("held_s"),
        "warnings": [{k: w.get(k) for k in ("warning", "detail", "next_action")}
                     for w in result.get("warnings", [])],
    }


def execution(result: dict[str, Any], stdout: str, stderr: str) -> dict[str, Any]:
    keys = ("status", "exit_code", "exception", "worker_pid", "recycled", "recycle_reason",
            "duration_s", "dispatch_s", "started_mono_s", "ended_mono_s")
    from krex.protocol.outcome import outcome

    return {**{k: result.get(k) for k in keys},
            "outcome": outcome(result["status"], result["exit_code"], result.get("recycle_reason")),
            "stdout": stdout, "stderr": stderr,
            "traceback": (result.get("traceback") or "")[-4000:] or None}
