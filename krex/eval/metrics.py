"""From the raw document to the numbers: throughput, inflation, handoff, overlaps.

Inflation of one timed kernel = its median ÷ the same kernel's median measured
alone, where "alone" is the faster of the references taken right before and
right after its block (drift between minutes cancels; interference from
outside krex — other users of the machine — only ever slows a reference
down, so the faster one is the better estimate of "alone", and it makes
inflation err on the high side).  Reported
in percent, as p50 / p95 / p99 per kernel-duration bucket (the *reported*
reading of :mod:`krex.measure.stats`; quantiles as defined there).
"""

from __future__ import annotations

from typing import Any

from krex.measure.stats import inflation_pct, quantiles


def references(block: dict[str, Any]) -> dict[str, float]:
    """Kernel name -> reference median (the faster of before and after)."""
    refs: dict[str, list[float]] = {}
    for side in ("before", "after"):
        for k in block["refs"].get(side) or []:
            if k.get("median_ms", 0) > 0:
                refs.setdefault(k["kernel"], []).append(k["median_ms"])
    return {name: min(v) for name, v in refs.items()}


def inflations(block: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per timed kernel: bucket, measured, reference, inflation %."""
    refs = references(block)
    rows = []
    for cmd in block["commands"]:
        for k in cmd["kernels"]:
            ref = refs.get(k["kernel"])
            if ref and k.get("median_ms"):
                rows.append({"bucket_ms": k["bucket_ms"], "kernel": k["kernel"],
                             "median_ms": k["median_ms"], "ref_ms": ref,
                             "inflation_pct": inflation_pct(k["median_ms"], ref),
                             "clean": (k.get("region") or {}).get("clean")})
    return rows


# A timed kernel this much slower than alone is a wrong measurement: its region must not be
# called clean (the truthfulness of the reports; issue 41's bar).
SLOW_PCT = 20.0


def slow_but_clean(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Timed kernels more than :data:`SLOW_PCT` above their reference (``slow``), and
    those of them whose region was reported clean (``clean``: each one a report that
    did not tell the truth)."""
    slow = [r for r in rows if r["inflation_pct"] > SLOW_PCT]
    return {"slow": len(slow), "clean": sum(r.get("clean") is True for r in slow)}


RANK_PAIR_PCT = (1.0, 5.0)  # candidate pairs: true times this far apart


def rank_flips(block: dict[str, Any]) -> list[dict[str, Any]]:
    """Candidate-rank flips: for every pair of kernels whose alone references differ by
    1-5 %, one row per command that timed both: ``flipped`` when its measured order is
    not the references' order (which of two close candidates is faster)."""
    refs = references(block)
    names = sorted(refs)
    lo, hi = RANK_PAIR_PCT
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
             if lo <= abs(inflation_pct(refs[a], refs[b])) <= hi]
    rows = []
    for cmd in block["commands"]:
        measured = {k["kernel"]: k["median_ms"] for k in cmd["kernels"] if k.get("median_ms")}
        for a, b in pairs:
            if a in measured and b in measured:
                rows.append({"pair": f"{a} vs {b}",
                             "ref_gap_pct": inflation_pct(refs[a], refs[b]),
                             "flipped": (measured[a] < measured[b]) != (refs[a] < refs[b])})
    return rows


def rank_flip_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    flips = sum(r["flipped"] for r in rows)
    return {"pairs": len({r["pair"] for r in rows}), "comparisons": len(rows), "flips": flips,
            "rate_pct": 100 * flips / len(rows) if rows else None}


def handoffs_us(regions: list[dict[str, Any]]) -> list[float]:
    """Release of one exclusive region -> grant of the next that was waiting, in µs."""
    spans = sorted((r for r in regions if r.get("exclusive") and not r.get("nested")),
                   key=lambda r: r["granted_mono_s"])
    out = []
    for prev, nxt in zip(spans, spans[1:], strict=False):
        gap_s = nxt["granted_mono_s"] - (prev["granted_mono_s"] + prev["held_s"])
        if (nxt.get("waited_s") or 0) > gap_s >= 0:
            out.append(gap_s * 1e6)
    return out


def overlaps(regions: list[dict[str, Any]]) -> int:
    """Exclusive, non-nested regions on one device whose [grant, release) intersect."""
    per_dev: dict[str, list[tuple[float, float]]] = {}
    for r in regions:
        if r.get("exclusive") and not r.get("nested"):
            start = r["granted_mono_s"]
            per_dev.setdefault(r["device"], []).append((start, start + r["held_s"]))
    n = 0
    for spans in per_dev.values():
        spans.sort()
        n += sum(b[0] < a[1] - 1e-6 for a, b in zip(spans, spans[1:], strict=False))
    return n


def timed_share(block: dict[str, Any]) -> float:
    """Fraction of the block's wall time the commands' timed loops held regions."""
    t0 = block["start_mono_s"]
    t1 = t0 + block["wall_s"]
    held = sum(r["held_s"] for r in block["regions"]
               if not str(r.get("job") or "").startswith("ref-")
               and str(r.get("label") or "").startswith("eval ")
               and t0 <= r["granted_mono_s"] <= t1)
    return held / block["wall_s"] if block["wall_s"] else 0.0


def reference_drift(block: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per kernel: how far its alone reference moved across the block, in %.

    Both references are the kernel alone; their difference is the machine's own
    drift over the block, the floor below which no inflation can be read.
    """
    before = {k["kernel"]: k for k in block["refs"].get("before") or [] if k.get("median_ms")}
    rows = []
    for k in block["refs"].get("after") or []:
        b = before.get(k["kernel"])
        bucket = k.get("bucket_ms", (b or {}).get("bucket_ms"))
        if b and k.get("median_ms") and bucket is not None:
            rows.append({"bucket_ms": bucket, "kernel": k["kernel"],
                         "inflation_pct": abs(inflation_pct(k["median_ms"], b["median_ms"]))})
    return rows


def _kind(row: dict[str, Any]) -> str:
    return str(row["kernel"]).split("-")[0]


def bucket_stats(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for b in sorted({r["bucket_ms"] for r in rows}):
        vals = [r["inflation_pct"] for r in rows if r["bucket_ms"] == b]
        out[f"{b:g}"] = {"n": len(vals), **quantiles(vals)}
    return out


def summarise_mode(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    cmds = [c for b in blocks for c in b["commands"]]
    wall = sum(b["wall_s"] for b in blocks)
    rows = [r for b in blocks for r in inflations(b)]
    hand = [h for b in blocks for h in handoffs_us(b["regions"])]
    kernels = [k for c in cmds for k in c["kernels"]]
    unclean = [k for k in kernels if not (k.get("region") or {}).get("clean")]
    reasons: dict[str, int] = {}
    for k in unclean:
        for reason in (k.get("region") or {}).get("reasons") or []:
            key = _reason_key(reason)
            reasons[key] = reasons.get(key, 0) + 1
    return {"commands": len(cmds), "failed": sum(not c["ok"] for c in cmds), "wall_s": wall,
            "throughput_cpm": 60 * sum(c["ok"] for c in cmds) / wall if wall else 0.0,
            "command_wall_p50_s": quantiles([c["wall_s"] for c in cmds], (0.5,))["p50"],
            "inflation_pct": bucket_stats(rows),
            "inflation_by_kind_pct": {kind: bucket_stats([r for r in rows if _kind(r) == kind])
                                      for kind in sorted({_kind(r) for r in rows})},
            "reference_drift_pct": bucket_stats([r for b in blocks for r in reference_drift(b)]),
            "handoff_us": {
                "n": len(hand), **quantiles(hand, (0.5, 0.95))},
            "overlaps": sum(overlaps(b["regions"]) for b in blocks),
            "rank_flips": rank_flip_summary([r for b in blocks for r in rank_flips(b)]),
            "regions_not_clean": len(unclean), "timed_kernels": len(kernels),
            "slow_kernels": slow_but_clean(rows),
            "timed_share": sum(timed_share(b) * b["wall_s"] for b in blocks) / wall if wall else 0,
            "device_utilisation": _utilisation(blocks),
            "loadavg_1min": _mean([x for b in blocks for x in b.get("loadavg_1min") or []]),
            "not_clean_reasons": reasons}


def _reason_key(reason: dict[str, Any]) -> str:
    """``mechanism_disabled (freeze)``: the code, and the mechanism when it names one."""
    mechanism = (reason.get("evidence") or {}).get("mechanism")
    return f"{reason['code']} ({mechanism})" if mechanism else str(reason["code"])


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _utilisation(blocks: list[dict[str, Any]]) -> float | None:
    busy = [b.get("device_busy_s") for b in blocks]
    if not busy or any(x is None for x in busy):
        return None
    return sum(x for x in busy if x is not None) / sum(b["wall_s"] for b in blocks)


def summarise(raw: dict[str, Any], modes: list[str]) -> dict[str, Any]:
    per = {m: summarise_mode([b for b in raw["blocks"] if b["mode"] == m]) for m in modes}
    base = per.get("command", {}).get("throughput_cpm") or 0.0
    for s in per.values():
        s["speedup_vs_command"] = s["throughput_cpm"] / base if base else float("nan")
    return per
