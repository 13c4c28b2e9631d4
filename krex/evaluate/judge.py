"""Pure judgement: from what the workers wrote to findings, correctness and a verdict.

Runs in the evaluator's process.  In: the reference's outputs, the candidate's
outputs and the program's summary (``isolation="process"``: written by the trusted
driver, no candidate code ran there; ``"worker"``: the candidate's program's return
value, which the candidate could reach) and the plan of cases.  Out: :class:`Judgement`.  Thresholds
are named constants; docs/evaluate.md explains each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from krex.evaluate import isolation, values
from krex.evaluate.findings import Code, Finding, invalidating
from krex.protocol.report import ReasonCode

Tree = tuple[dict[str, Any], dict[str, Any]]  # (structure, arrays)

KIND_CODES = {"structure": Code.WRONG_STRUCTURE, "shape": Code.WRONG_SHAPE,
              "dtype": Code.WRONG_DTYPE, "non_finite": Code.NON_FINITE,
              "values": Code.WRONG_OUTPUT}
CORRECTNESS_CODES = {*KIND_CODES.values(), Code.WRONG_ON_HELD_OUT, Code.WRONG_DURING_TIMING,
                     Code.STALE_OUTPUT, Code.INPUT_MUTATED, Code.OUTPUT_ALIASES_INPUT,
                     Code.NONDETERMINISTIC}
AFTER_LAUNCHES_PER_GAP = 0.05  # stray launches per gap (krex's own flushes excluded)
THREAD_CPU_SLACK_MS = 10.0  # scheduler-tick granularity of other threads' CPU time
PROBE_CPU_MIN_MS = 0.5  # the candidate's threads' CPU in the quiet windows after its calls,
PROBE_CPU_PER_CALL = 0.5  # beyond this floor and this share of the calls' own wall time
HOST_MIN_MS = 0.05  # a device timer reading below a quarter of the call's host time ...
TIMER_HOST_RATIO = 0.25  # ... (for calls of at least this much host time) missed work
BURST_PENDING_MIN_MS = 10.0  # work still queued after a burst of calls and a context sync,
BURST_PENDING_SHARE = 0.5  # beyond this floor and this share of the burst's own time (a drain's
# latency alone reaches a few ms when the machine is busy)
DRAIN_TIMEOUT_MS = 1000.0  # counters.DRAIN_TIMEOUT_S: a drain that never finished
LAUNCH_RATIO = 4.0  # max/min launches per call beyond this varies "wildly"
TIMING_FLAGS = ("REGION_NOT_CLEAN", "ENFORCEMENT_IMPOSSIBLE", "REGION_REVOKED", "THROTTLED")
DISTURBED_FLAGS = ("REGION_REVOKED", "THROTTLED")  # always evidence against the samples; a
# REGION_NOT_CLEAN is when its region report holds a reason that is not a gap (a
# mechanism missing on this machine or switched off: TIMING_NOT_ENFORCED)
SCREENED_REASONS = ("holder_preempted", "foreign_task")  # compare's screen_offcpu set aside
# every pair with a preempted sample: these reasons say nothing against the pairs kept ...
SCREEN_MAX_SHARE = 0.5  # ... unless more than this share of the pairs had to be set aside
# (the holder shared its core for most of the region: not an exclusive measurement)


@dataclass
class Judgement:
    findings: list[Finding] = field(default_factory=list)
    correct: bool | None = None
    verdict: str = "invalid"
    correctness: dict[str, Any] = field(default_factory=dict)


def judge(plan: dict[str, Any], ref: Tree | None, cand: Tree | None,
          summary: dict[str, Any], options: dict[str, Any]) -> Judgement:
    j = Judgement()
    if ref is not None and cand is not None:
        _correctness(j, plan, ref, cand, summary, options)
    if summary.get("status") == "error" and isolation.candidate_error(summary):
        j.findings.append(Finding(Code.CANDIDATE_ERROR,
                                  f"in stage {summary.get('stage')}: {summary.get('exception')}",
                                  {"stage": summary.get("stage"),
                                   "traceback": summary.get("traceback", "")}))
    j.findings += integrity(summary, options) + isolation.findings(summary)
    j.findings = merge(j.findings)
    if j.correct is None and any(f.code in CORRECTNESS_CODES for f in j.findings):
        j.correct = False
    comparison = summary.get("comparison")
    if invalidating(j.findings):
        j.verdict = "invalid"
    elif comparison and not any(f.code is Code.TIMING_UNTRUSTED for f in j.findings):
        j.verdict = timing_verdict(comparison, options["same_within"])
    else:  # no timing, or timing krex itself distrusts: no speed claim from it
        j.verdict = "unclear"
    return j


def timing_verdict(c: dict[str, Any], same_within: float) -> str:
    """faster / slower / same / unclear: material *and* significant, or equivalent.

    ``faster``: the interval lies above 1 and the estimate at or above
    ``1 + same_within``; ``slower`` the mirror image; ``same``: the interval
    lies within ``1 ± 2 x same_within`` (a 0.5 % difference that compare's
    sequential test happened to resolve is not "faster"); else ``unclear``.
    Where an interval is both (within the band, 1 excluded, the estimate past
    ``1 ± same_within``), it is ``faster``/``slower`` only if it lies wholly past
    that materiality line, else ``same``: identical code under load gives such
    intervals, e.g. 0.969x [0.948, 0.999], 3 in 40 in a loaded suite run.
    """
    w = same_within
    speedup, low, high = c["speedup"], c["ci_low"], c["ci_high"]
    within_band = low >= 1.0 / (1.0 + 2 * w) and high <= 1.0 + 2 * w
    if low > 1.0 and speedup >= 1.0 + w and not (within_band and low <= 1.0 + w):
        return "faster"
    if high < 1.0 and speedup <= 1.0 / (1.0 + w) and not (within_band and high >= 1.0 / (1.0 + w)):
        return "slower"
    if within_band:
        return "same"
    return "unclear"


def merge(findings: list[Finding]) -> list[Finding]:
    """One finding per code: the first one's message, every occurrence's evidence."""
    by_code: dict[Code, Finding] = {}
    for f in findings:
        first = by_code.get(f.code)
        if first is None:
            by_code[f.code] = Finding(f.code, f.message, dict(f.evidence))
            continue
        more = first.evidence.setdefault("more", [])
        if len(more) < 10:
            more.append({"message": f.message, **f.evidence})
        first.evidence["occurrences"] = first.evidence.get("occurrences", 1) + 1
    return list(by_code.values())


# -- correctness -------------------------------------------------------------------------


def _cases(data: Tree) -> set[str]:
    return set(data[0])


def _problems(ref: Tree, ref_case: str, cand: Tree, cand_case: str,
              options: dict[str, Any]) -> list[dict[str, Any]]:
    return values.compare((ref[0][ref_case], ref[1]), (cand[0][cand_case], cand[1]),
                          options.get("atol"), options.get("rtol"))


def _correctness(j: Judgement, plan: dict[str, Any], ref: Tree, cand: Tree,
                 summary: dict[str, Any], options: dict[str, Any]) -> None:
    checked: list[str] = []
    for case in plan["correctness"]:
        if case["id"] in _cases(cand):
            checked.append(case["id"])
            for p in _problems(ref, case["id"], cand, case["id"], options):
                j.findings.append(Finding(KIND_CODES[p["kind"]], f"seed {case['seed']}: "
                                          f"{p['detail']}", {**p, "case": case}))
    for case_id in summary.get("mutated", []):
        j.findings.append(Finding(Code.INPUT_MUTATED, f"inputs of case {case_id} changed "
                                  "during the call", {"case": case_id}))
    if summary.get("aliases"):
        first = summary["aliases"][0]
        j.findings.append(Finding(Code.OUTPUT_ALIASES_INPUT, f"output {first['output']} shares "
                                  f"memory with input {first['input']}",
                                  {"aliases": summary["aliases"][:10]}))
    wrong = any(f.code in KIND_CODES.values() for f in j.findings)
    if checked and not wrong:
        _staged(j, plan, ref, cand, options)
        if summary.get("precheck_wrong"):  # wrong when checked after the call, right later
            j.findings.append(Finding(Code.WORK_AFTER_RETURN, "outputs of "
                                      f"{', '.join(summary['precheck_wrong'])} were still being "
                                      "written after the call returned",
                                      {"changed_after_return": summary["precheck_wrong"]}))
    j.correctness = _correctness_summary(plan, checked, cand, options)
    j.correct = bool(checked) and not any(f.code in CORRECTNESS_CODES for f in j.findings) \
        and _complete(plan, cand, summary)


def _complete(plan: dict[str, Any], cand: Tree, summary: dict[str, Any]) -> bool:
    """Every planned case was run (a crash half-way is not 'correct')."""
    return summary.get("status") == "ok" and all(
        c["id"] in _cases(cand) for c in plan["correctness"] + plan["held_out"])


def _staged(j: Judgement, plan: dict[str, Any], ref: Tree, cand: Tree,
            options: dict[str, Any]) -> None:
    """Determinism, identity, timed and held-out checks (the candidate passed the basics)."""
    first = plan["correctness"][0]["id"]
    if "determinism" in _cases(cand):
        problems = _problems(cand, first, cand, "determinism", options)
        if problems:
            j.findings.append(Finding(Code.NONDETERMINISTIC, problems[0]["detail"],
                                      {"problems": problems[:3]}))
        elif _digest(cand, first) != _digest(cand, "determinism"):
            j.findings.append(Finding(Code.NOT_BITWISE_DETERMINISTIC,
                                      "re-run differs in the last bits", {}))
    second = plan["identity"][1]["id"]
    if "identity" in _cases(cand):
        problems = _problems(ref, second, cand, "identity", options)
        if problems:
            j.findings.append(Finding(Code.STALE_OUTPUT, "after refilling the same input "
                                      f"objects with seed {plan['identity'][1]['seed']}: "
                                      f"{problems[0]['detail']}", {"problems": problems[:3]}))
    for key in sorted(k for k in _cases(cand) if k.startswith("timed/")):
        case = plan["rotation"][int(key.split("/")[1])]
        problems = _problems(ref, case["id"], cand, key, options)
        if problems:
            j.findings.append(Finding(Code.WRONG_DURING_TIMING, f"timed input set {key} "
                                      f"(seed {case['seed']}): {problems[0]['detail']}",
                                      {"problems": problems[:3], "case": case}))
            break
    for case in plan["held_out"]:
        if case["id"] in _cases(cand):
            problems = _problems(ref, case["id"], cand, case["id"], options)
            if problems:
                j.findings.append(Finding(Code.WRONG_ON_HELD_OUT,
                                          f"seed {case['seed']} shape {case.get('shape')}: "
                                          f"{problems[0]['detail']}",
                                          {"problems": problems[:3], "case": case}))
    if len(plan.get("shapes", [None])) < 2:
        j.findings.append(Finding(Code.NO_HELD_OUT_SHAPE, "held out: new seeds only", {}))


def _digest(tree: Tree, case: str) -> str:
    return values.digest(tree[0][case], tree[1])


def _correctness_summary(plan: dict[str, Any], checked: list[str], cand: Tree,
                         options: dict[str, Any]) -> dict[str, Any]:
    dtypes = sorted({s["dtype"] for s in _array_structs(cand[0].get(checked[0]) if checked
                                                           else None)})
    return {"cases_checked": len(checked) + sum(1 for c in _cases(cand) if c not in checked),
            "seeds": [c["seed"] for c in plan["correctness"]],
            "shapes": plan.get("shapes"), "held_out": [c["id"] for c in plan["held_out"]],
            "tolerances": {d: values.tolerance(d, options.get("atol"), options.get("rtol"))
                           for d in dtypes}}


def _array_structs(s: dict[str, Any] | None) -> list[dict[str, Any]]:
    if s is None:
        return []
    if s["t"] == "array":
        return [s]
    return [a for item in s.get("items", []) for a in _array_structs(item)]


# -- integrity ---------------------------------------------------------------------------


def integrity(summary: dict[str, Any], options: dict[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    if summary.get("tampered"):
        names = summary["tampered"]
        out.append(Finding(Code.KREX_TAMPERED, f"{len(names)} trusted bindings changed: "
                           + ", ".join(names[:5]), {"changed": names[:50]}))
    counters = summary.get("counters") or {}
    cand, ref = counters.get("candidate"), counters.get("reference")
    comparison = summary.get("comparison")
    if cand and ref:
        out += _launches(cand, ref)
        out += _after_return(cand, ref, summary.get("probe") or [],
                             summary.get("bursts") or [], comparison,
                             int(summary.get("threads_started") or 0))
    if comparison:
        out += _timing(comparison, options)
    if summary.get("timing_error"):
        out.append(Finding(Code.TIMING_FAILED, summary["timing_error"], {}))
    return out


def _mode(values: list[int]) -> int:
    return max(set(values), key=values.count)


def _launches(cand: dict[str, Any], ref: dict[str, Any]) -> list[Finding]:
    counts, ref_counts = cand["launches_in_call"], ref["launches_in_call"]
    if not counts or not ref_counts:
        return []
    evidence = {"candidate_min": min(counts), "candidate_max": max(counts),
                "reference_typical": _mode(ref_counts), "calls": len(counts)}
    if max(counts) == 0 and max(ref_counts) > 0:
        return [Finding(Code.NO_DEVICE_WORK, f"0 launches in each of {len(counts)} timed calls "
                        f"(the reference launches {evidence['reference_typical']})", evidence)]
    low, high = min(counts), max(counts)
    if high > LAUNCH_RATIO * max(low, 1) or (low == 0 < high):
        return [Finding(Code.LAUNCH_COUNT_VARIES, f"launches per timed call from {low} to {high}",
                        evidence)]
    return []


def _thread_cpu_beyond_calls(cand: dict[str, Any], ref: dict[str, Any],
                             comparison: dict[str, Any] | None,
                             threads: int) -> dict[str, Any] | None:
    """The candidate's threads used more CPU during the loop than its calls lasted.

    The kernel updates a running thread's CPU time at scheduler ticks, so the
    split in-call / after-call of one sample is coarse; the total over the
    loop is not.  Threads the candidate started may legitimately run only
    while its calls run: at most ``threads`` x the candidate's timed time.
    """
    if not comparison or not threads:
        return None
    total_ms = sum(s[k] for s in (cand, ref) for k in ("thread_cpu_in_call_ms",
                                                       "thread_cpu_after_ms"))
    allowed_ms = threads * sum(comparison.get("candidate_samples_ms", [])) * 1.1 \
        + THREAD_CPU_SLACK_MS
    if total_ms <= allowed_ms:
        return None
    return {"thread_cpu_ms": round(total_ms, 3), "thread_cpu_allowed_ms": round(allowed_ms, 3),
            "threads_started": threads}


def _after_return(cand: dict[str, Any], ref: dict[str, Any], probe_calls: list[dict[str, Any]],
                  bursts: list[dict[str, Any]], comparison: dict[str, Any] | None,
                  threads: int) -> list[Finding]:
    evidence: dict[str, Any] = {}
    typical = _mode(ref["launches_in_call"]) if ref["launches_in_call"] else 0
    foreign = sum(max(0, n - typical) for n in ref["launches_in_call"])
    if foreign >= 2:  # the reference launches the same each call: the extra came from elsewhere
        evidence["launches_during_reference_calls"] = foreign
    gaps = max(cand["gaps"], 1)
    stray = cand["launches_after"] / gaps - ref["launches_after"] / max(ref["gaps"], 1)
    if stray > AFTER_LAUNCHES_PER_GAP:
        evidence["launches_after_per_call"] = round(cand["launches_after"] / gaps, 3)
    cpu = _thread_cpu_beyond_calls(cand, ref, comparison, threads)
    if cpu is not None:
        evidence.update(cpu)
    evidence.update(_probe_evidence(probe_calls, bursts,
                                    ref["launches_after"] / max(ref["gaps"], 1)))
    evidence.update(_timer_below_host(probe_calls, comparison))
    if not evidence:
        return []
    what = ", ".join(f"{k}={v}" for k, v in evidence.items())
    return [Finding(Code.WORK_AFTER_RETURN, what, {**evidence, "gaps": cand["gaps"]})]


def _pending(calls: list[dict[str, Any]], bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """Device work still queued after the calls returned and the timer's context was synced."""
    drains = [x["pending_ms"] for x in [*calls, *bursts] if x["pending_ms"] is not None]
    mine = [b for b in bursts if b["side"] == "candidate" and b["pending_ms"] is not None]
    if (drains and max(drains) >= DRAIN_TIMEOUT_MS) or \
            (mine and mine[0]["pending_ms"] > max(BURST_PENDING_MIN_MS,
                                                  BURST_PENDING_SHARE * mine[0]["synced_ms"])):
        return {"pending_after_sync_ms": [round(d, 3) for d in drains],
                "candidate_burst": mine[0] if mine else None}
    return {}


def _timer_below_host(calls: list[dict[str, Any]],
                      comparison: dict[str, Any] | None) -> dict[str, Any]:
    """The device timer saw much less than the call's own host time.

    Events recorded before and after a call on an idle stream span at least
    the host time between the two records; a timed median far below it
    means the device was busy elsewhere meanwhile — with the candidate's
    work on another context or stream, which the events do not include.  The
    fastest host call is used, and a call that was preempted (an involuntary
    context switch in it) counts its thread's CPU time only: preemption on a
    busy machine lengthens host calls, never the device's reading, and three
    probe calls may all have been preempted (a false WORK_AFTER_RETURN on a
    loaded fakegpu); a call blocked waiting (a voluntary switch) keeps its
    wall time.
    """
    host = [c["call_cpu_ms"] if c.get("preempted") else c["call_ms"]
            for c in calls if c["side"] == "candidate"]
    if not host or not comparison or comparison.get("timer") == "cpu":
        return {}
    host_ms, timed_ms = min(host), comparison["candidate"].get("median_ms", 0.0)
    if host_ms > HOST_MIN_MS and timed_ms < TIMER_HOST_RATIO * host_ms:
        return {"timed_median_ms": timed_ms, "host_call_min_ms": round(host_ms, 4)}
    return {}


def _probe_evidence(calls: list[dict[str, Any]], bursts: list[dict[str, Any]],
                    ref_after_per_call: float = 0.0) -> dict[str, Any]:
    """``ref_after_per_call``: the reference's launches after a call in the timed loop's
    gaps (probe records of before 2026-12-02 probed the reference too: theirs count)."""
    mine = [c for c in calls if c["side"] == "candidate"]
    theirs = [c for c in calls if c["side"] == "reference"]
    out: dict[str, Any] = {}
    if not mine:
        return out
    launches = [c["launches_after"] for c in mine if c["launches_after"] is not None]
    ref_launches = [c["launches_after"] for c in theirs if c["launches_after"] is not None]
    baseline = sum(ref_launches) if ref_launches else ref_after_per_call * len(launches)
    if launches and sum(launches) > baseline and sum(launches) >= 2:
        out["probe_launches_after"] = launches
    out.update(_pending(calls, bursts))
    cpu_ms = sum(c["thread_cpu_after_ms"] for c in mine)
    call_ms = sum(min(c["call_ms"], c.get("call_cpu_ms", c["call_ms"])) for c in mine)
    if cpu_ms > max(PROBE_CPU_MIN_MS, PROBE_CPU_PER_CALL * call_ms):  # CPU: others' load
        # (the probe runs outside the region on cpu) does not lengthen it
        out["probe_thread_cpu_after_ms"] = [round(c["thread_cpu_after_ms"], 3) for c in mine]
        out["probe_call_ms"] = [round(c["call_ms"], 3) for c in mine]
    return out


def disturbance(comparison: dict[str, Any]) -> list[str]:
    """What says the timed samples themselves were disturbed: a revocation, throttling,
    or a reason in the (last) region's report that is not a gap (the holder preempted,
    a foreign task on its cores, a step that failed or timed out ...).  Empty when the
    only caveat is enforcement that did not happen at all (a gap): nothing was seen
    to disturb the samples then, though nothing was kept away either."""
    names = {w["warning"] for w in comparison.get("warnings", [])}
    out = [n for n in DISTURBED_FLAGS if n in names]
    screened = _screened(comparison)
    for reason in (comparison.get("region") or {}).get("reasons", []):
        code = str(reason.get("code"))
        if not _gap(code) and code not in out and not (screened and code in SCREENED_REASONS):
            out.append(code)
    if "REGION_NOT_CLEAN" in names and not comparison.get("region"):
        out.append("REGION_NOT_CLEAN")  # no report to say why: not clean is not trusted
    return out


def _screened(comparison: dict[str, Any]) -> bool:
    """compare set aside every pair with a preempted sample, and most pairs were kept."""
    if not comparison.get("screened"):
        return False
    kept, dropped = comparison.get("pairs") or 0, comparison.get("discarded_pairs") or 0
    return kept > 0 and dropped <= SCREEN_MAX_SHARE * (kept + dropped)


def _gap(code: str) -> bool:
    try:
        return ReasonCode(code).gap
    except ValueError:  # a reason this krex does not know: not a gap it can vouch for
        return False


def _trust(comparison: dict[str, Any], untrusted: list[dict[str, Any]]) -> list[Finding]:
    """TIMING_UNTRUSTED when the samples were disturbed; else TIMING_NOT_ENFORCED for
    enforcement that did not happen (gaps), and the note TIMING_SCREENED when the holder's
    contention was answered by setting aside the pairs it hit."""
    what = "; ".join(f"{w['warning']}: {w['detail']}" for w in untrusted)
    disturbed = disturbance(comparison)
    evidence = {"warnings": untrusted, "disturbed_by": disturbed}
    if disturbed:
        return [Finding(Code.TIMING_UNTRUSTED, what, evidence)]
    reasons = [str(r.get("code")) for r in (comparison.get("region") or {}).get("reasons", [])]
    out = []
    if any(w["warning"] == "ENFORCEMENT_IMPOSSIBLE" for w in untrusted) or \
            any(_gap(code) for code in reasons):
        out.append(Finding(Code.TIMING_NOT_ENFORCED, what, evidence))
    screened = sorted({code for code in reasons if code in SCREENED_REASONS})
    if screened:
        kept, dropped = comparison.get("pairs"), comparison.get("discarded_pairs")
        why = ", ".join(screened)
        out.append(Finding(Code.TIMING_SCREENED, f"{dropped} pairs set aside ({why}): the "
                           f"verdict is from the {kept} undisturbed ones",
                           {"discarded_pairs": dropped, "pairs": kept, "reasons": screened}))
    return out


def _timing(comparison: dict[str, Any], options: dict[str, Any]) -> list[Finding]:
    out = []
    names = {w["warning"]: w for w in comparison.get("warnings", [])}
    if "PLAUSIBILITY_FAILED" in names:
        out.append(Finding(Code.TIMER_IMPLAUSIBLE, names["PLAUSIBILITY_FAILED"]["detail"], {}))
    untrusted = [names[n] for n in TIMING_FLAGS if n in names]
    if untrusted:
        out += _trust(comparison, untrusted)
    bound = options.get("plausible_speedup")
    speedup = comparison.get("speedup") or 0.0
    if bound and speedup > bound:
        out.append(Finding(Code.IMPLAUSIBLE_SPEEDUP, f"speedup {speedup:.1f}x > bound {bound:g}x",
                           {"speedup": speedup, "bound": bound}))
    return out
