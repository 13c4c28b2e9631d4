"""The results file (versioned JSON, written atomically) and its markdown table.

Document: ``format``, ``kind: "krex-eval"``, ``device``, ``agents``,
``commands``, ``modes``, ``profile``, ``machine``, ``command`` (exact command
line), ``date``, ``spec`` (calibrated kernels and compile size), ``alone``,
``blocks`` (raw: commands, kernels, references, region records),
``summary`` (per mode, :mod:`krex.eval.metrics`) and ``bound``
(:mod:`krex.eval.bound`).  Tables and plots are made from this file only.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from typing import Any

from krex import resultfile

KIND = "krex-eval"
FORMAT = 2  # 2: region records with *_mono_s timestamps, reasons instead of not_enforced


def machine() -> dict[str, Any]:
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"host": platform.node(), "cpus": os.cpu_count(), "memory_gib": round(mem_gib, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine()}


def document(raw: dict[str, Any], summary: dict[str, Any], bound: dict[str, Any],
             meta: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "kind": KIND, **meta, "machine": machine(),
            "command": " ".join(["krex", *sys.argv[1:]]) if meta.get("command") is None
            else meta["command"], "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            **raw, "summary": summary, "bound": bound}


def write(doc: dict[str, Any], path: str) -> str:
    """Write ``doc`` to ``path`` atomically (:mod:`krex.resultfile`)."""
    return resultfile.write(path, doc)


def load(path: str) -> dict[str, Any]:
    return resultfile.read(path, kind=KIND, format=FORMAT)


def _f(x: float | None, nd: int = 1) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def _load_line(doc: dict[str, Any]) -> str:
    loads = [x for b in doc["blocks"] for x in b.get("loadavg_1min") or []]
    if not loads:
        return ""
    return (f"\nMachine 1-min load average at block starts and ends: {min(loads):.1f}–"
            f"{max(loads):.1f} on {doc['machine']['cpus']} cores (everything on the machine, "
            "krex's own commands included).\n")


def table_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    buckets = [f"{b:g}" for b in doc["profile"]["buckets_ms"]]
    cols = ["mode", "cmd/min", "× command", "bound", "eff. %", "bound 16c",
            *[f"p95 infl. ≥{b} ms %" for b in reversed(buckets)], "p99 ≥0.1 ms %",
            "handoff p50 µs", "timed %", "device busy %", "not clean", "slow but clean",
            "rank flips %",
            "overlaps", "failed"]
    rows = []
    bound = doc["bound"]["per_mode_cpm"]
    node = doc["bound"]["node16_per_mode_cpm"]
    for mode, s in doc["summary"].items():
        infl = s["inflation_pct"]
        eff = 100 * s["throughput_cpm"] / bound[mode] if bound.get(mode) else None
        rows.append([mode, _f(s["throughput_cpm"]), _f(s["speedup_vs_command"], 2),
                     _f(bound.get(mode)), _f(eff, 0), _f(node.get(mode)),
                     *[_f(infl.get(b, {}).get("p95"), 2) for b in reversed(buckets)],
                     _f(infl.get(buckets[0], {}).get("p99"), 2),
                     _f(s["handoff_us"]["p50"], 0), _f(100 * s.get("timed_share", 0.0), 0),
                     _f(None if s.get("device_utilisation") is None
                        else 100 * s["device_utilisation"], 0),
                     f"{s['regions_not_clean']}/{s['timed_kernels']}", _slow(s), _flips(s),
                     str(s["overlaps"]),
                     str(s["failed"])])
    return cols, rows


def _slow(summary: dict[str, Any]) -> str:
    """``clean/slow``: timed kernels > 20 % above alone whose region was called clean, of
    all that slow (metrics.slow_but_clean); ``–`` in a results file from before it."""
    slow = summary.get("slow_kernels")
    return f"{slow['clean']}/{slow['slow']}" if slow else "–"


def _flips(summary: dict[str, Any]) -> str:
    """``rate (flips/comparisons)``; ``–`` when no pair of kernels was 1-5 % apart."""
    r = summary.get("rank_flips") or {}
    if not r.get("comparisons"):
        return "–"
    return f"{_f(r['rate_pct'], 0)} ({r['flips']}/{r['comparisons']})"


def kind_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """p95 inflation per kernel kind and bucket, beside the references' own drift."""
    buckets = [f"{b:g}" for b in reversed(doc["profile"]["buckets_ms"])]
    first: dict[str, Any] = next(iter(doc["summary"].values()), {})
    kinds = list(first.get("inflation_by_kind_pct") or {})
    cols = ["mode", *[f"{k} ≥{b} ms" for k in kinds for b in buckets],
            *[f"ref drift ≥{b} ms" for b in buckets]]
    rows = []
    for mode, s in doc["summary"].items():
        by_kind = s.get("inflation_by_kind_pct") or {}
        drift = s.get("reference_drift_pct") or {}
        rows.append([mode, *[_f(by_kind.get(k, {}).get(b, {}).get("p95"), 2)
                             for k in kinds for b in buckets],
                     *[_f(drift.get(b, {}).get("p95"), 2) for b in buckets]])
    return cols, rows


def console_notes(doc: dict[str, Any]) -> list[str]:
    """What the console says under the table: each bucket whose readings lie below the
    machine's noise floor, and why regions were not clean, per mode."""
    return [*_noise_floor_notes(doc), *_not_clean_notes(doc)]


def _noise_floor_notes(doc: dict[str, Any]) -> list[str]:
    """A bucket where the references' own drift (p95, the worst mode's) is as large as the
    p95 inflations compared (the largest, or the spread between modes): unreadable."""
    notes = []
    for b in (f"{x:g}" for x in doc["profile"]["buckets_ms"]):
        infl = {m: (s.get("inflation_pct") or {}).get(b, {}).get("p95")
                for m, s in doc["summary"].items()}
        infl = {m: v for m, v in infl.items() if v is not None and math.isfinite(v)}
        drifts = [(s.get("reference_drift_pct") or {}).get(b, {}).get("p95")
                  for s in doc["summary"].values()]
        drifts = [d for d in drifts if d is not None and math.isfinite(d)]
        if not infl or not drifts:
            continue
        compared = max(max(abs(v) for v in infl.values()),
                       max(infl.values()) - min(infl.values()))
        if max(drifts) >= compared:
            readings = ", ".join(f"{m} {v:.1f} %" for m, v in infl.items())
            notes.append(f"warning: below the noise floor at ≥{b} ms: the machine's own drift "
                         f"(p95 {max(drifts):.1f} %) is as large as the p95 inflations "
                         f"compared ({readings}); they cannot be told apart (next: run on a "
                         "quieter machine or with more rounds, and read the longer buckets)")
    return notes


def _not_clean_notes(doc: dict[str, Any]) -> list[str]:
    notes = []
    for mode, s in doc["summary"].items():
        if not s.get("regions_not_clean"):
            continue
        why = sorted((s.get("not_clean_reasons") or {}).items(), key=lambda kv: -kv[1])
        because = ", ".join(f"{code} ×{n}" for code, n in why) or "no reason recorded"
        notes.append(f"not clean: {mode} {s['regions_not_clean']}/{s['timed_kernels']}: "
                     f"{because} (docs/protocol.md, reason codes)")
    return notes


def _md(cols: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *["| " + " | ".join(r) + " |" for r in rows]]


def markdown(doc: dict[str, Any]) -> str:
    lines = _md(*table_rows(doc))
    if any("inflation_by_kind_pct" in s for s in doc["summary"].values()):
        lines += ["", "p95 inflation per kernel kind, % — and `ref drift`: p95 of how far the "
                  "alone references before and after a block differ (the machine's drift, the "
                  "floor of this reading):", "", *_md(*kind_rows(doc))]
    ph = doc["bound"]["phase_sizes_s"]
    m = doc["machine"]
    head = (f"`{doc['command']}` — {doc['date']}; {m['cpus']} cores, {m['memory_gib']} GiB, "
            f"Linux {m['kernel']}; device `{doc['device']}`, {doc['agents']} agents, "
            f"profile `{doc['profile']['name']}`.\n\nPhase sizes alone (s): "
            + ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in ph.items()) + "\n"
            + _load_line(doc))
    return head + "\n" + "\n".join(lines) + "\n"
