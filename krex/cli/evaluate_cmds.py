"""``krex evaluate`` and ``krex history``: registration here, work imported only when run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from krex.errors import BadRequest


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="is a candidate kernel correct and faster?",
                       description="Check a candidate against a reference on several seeds and "
                                   "shapes, time both A/B in one region, and report the verdict, "
                                   "the speedup and every integrity finding.  The result is "
                                   "stored in the records database (krex history).")
    p.add_argument("--ref", help="reference, as path.py:function")
    p.add_argument("--cand", required=True,
                   help="candidate, as path.py:function (with --kernelbench: SOLUTION.py)")
    p.add_argument("--inputs", help="inputs builder, path.py:function(seed[, shape]) -> args")
    p.add_argument("--kernelbench", metavar="PROBLEM.py",
                   help="a KernelBench problem (Model, get_inputs, get_init_inputs) against "
                        "the solution --cand names (ModelNew); instead of --ref and --inputs")
    p.add_argument("--device", help="cpu, fakegpu:N, cuda:N, rocm:N (default $KREX_DEVICE or cpu)")
    p.add_argument("--seeds", type=int, default=3, help="correctness seeds (default 3)")
    p.add_argument("--shapes", help="JSON list of shapes: the first timed, the rest held out "
                                    "(default: SHAPES beside the inputs builder)")
    p.add_argument("--atol", type=float, help="absolute tolerance (default by dtype)")
    p.add_argument("--rtol", type=float, help="relative tolerance (default by dtype)")
    p.add_argument("--cache", choices=("cold", "hot"), default="cold",
                   help="flush caches between timed calls (default cold)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="the candidate's whole run; a hang past it is TIMEOUT (default 120)")
    p.add_argument("--fresh", action="store_true",
                   help="measure again even if an identical request is recorded")
    p.add_argument("--records", help="records database (default $KREX_RECORDS_DB or "
                                     "~/.local/share/krex/records.sqlite3)")
    p.add_argument("--sandbox", choices=("auto", "required", "off"), default="auto",
                   help="the candidate's process: auto (a uid of its own where the driver "
                        "is root, no network, a private tmp, limits: as far as this machine "
                        "allows, the rest named in the record), required (refuse without "
                        "all of it), off (as the driver runs)")
    p.add_argument("--json", action="store_true", help="print the whole evaluation as JSON")
    p.set_defaults(func=cmd_evaluate)


def add_history(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("history", help="stored evaluations: list, show, export",
                       description="List recorded evaluations (default), show one, or export "
                                   "all of them as JSONL or CSV.")
    p.add_argument("--records", help="records database (default as for krex evaluate)")
    p.add_argument("--json", action="store_true", help="JSON output")
    p.add_argument("--limit", type=int, default=20, help="rows to list (default 20)")
    p.add_argument("action", nargs="?", choices=("list", "show", "export"), default="list")
    p.add_argument("id", nargs="?", help="evaluation id (or a unique prefix) for show")
    p.add_argument("--format", choices=("jsonl", "csv"), default="jsonl", help="for export")
    p.add_argument("--out", help="export to this file (default stdout)")
    p.set_defaults(func=cmd_history)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from krex.evaluate.pipeline import evaluate

    shapes = _shapes(args.shapes)
    ref, cand, inputs = _sides(args)
    ev = evaluate(ref, cand, inputs, device=args.device, atol=args.atol,
                  rtol=args.rtol, seeds=args.seeds, shapes=shapes, cache=args.cache,
                  timeout_s=args.timeout_s, fresh=args.fresh, records=args.records,
                  sandbox=args.sandbox)
    if args.json:
        from krex.cli.output import print_json

        print_json(json_of(ev.to_dict()))
    else:
        _print_evaluation(ev.to_dict())
    return 0


def _sides(args: argparse.Namespace) -> tuple[str, str, str]:
    """(reference, candidate, inputs) specs: as given, or a KernelBench pair's."""
    if args.kernelbench is None:
        if not args.ref or not args.inputs:
            raise BadRequest("krex evaluate needs --ref and --inputs (or --kernelbench)",
                             hint="--ref ref.py:fn --cand cand.py:fn --inputs ref.py:make, or "
                                  "--kernelbench PROBLEM.py --cand SOLUTION.py")
        return args.ref, args.cand, args.inputs
    if args.ref or args.inputs:
        raise BadRequest("--kernelbench takes the place of --ref and --inputs",
                         hint="krex evaluate --kernelbench PROBLEM.py --cand SOLUTION.py")
    if args.shapes:
        raise BadRequest("--shapes does not apply to --kernelbench: a KernelBench problem's "
                         "get_inputs() fixes its shapes", hint="leave out --shapes")
    from krex.evaluate.kernelbench import specs

    s = specs(args.kernelbench, args.cand)
    return s["reference"], s["candidate"], s["inputs"]


def json_of(ev: dict[str, Any]) -> dict[str, Any]:
    """``krex evaluate --json``: the record, with the names SKILL.md has an agent read
    (as the service answers them): ``record_id``, ``region_clean``, ``pooled_pairs``
    and ``extends``."""
    from krex.evaluate.result import pooling

    region = (ev.get("timing") or {}).get("region") or {}
    return {**ev, "record_id": ev["id"], "region_clean": region.get("clean"), **pooling(ev)}


def _shapes(text: str | None) -> list[Any] | None:
    if text is None:
        return None
    try:
        shapes = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"--shapes is not JSON: {exc}", hint='e.g. --shapes "[[128, 256]]"') \
            from None
    if not isinstance(shapes, list) or not shapes:
        raise BadRequest("--shapes must be a non-empty JSON list", hint='e.g. "[[128, 256]]"')
    return shapes


def _print_evaluation(ev: dict[str, Any]) -> None:
    from krex.cli.output import console, table

    invalid = ev["verdict"] == "invalid"  # a wrong or cheating candidate's speed means nothing
    speed = "" if ev["speedup"] is None or invalid else \
        f"  speedup {ev['speedup']:.3f}x [{ev['ci_low']:.3f}, {ev['ci_high']:.3f}]"
    reused = "  (stored result: identical request; --fresh measures again)" if ev["reused"] else ""
    pooled = (ev.get("timing") or {}).get("pooled")
    if pooled:
        reused = f"  (pooled: {pooled['pairs']} pairs, with record {pooled['extends']}'s)"
    console.print(f"{ev['id']}  verdict [bold]{ev['verdict']}[/bold]{speed}  "
                  f"correct {ev['correct']}  status {ev['status']}{reused}")
    if ev["findings"]:
        table(None, ["finding", "severity", "what", "next action"],
              [(f["code"], f["severity"], f["message"][:100], f["next_action"])
               for f in ev["findings"]])
    timing = ev.get("timing") or {}
    if timing and not invalid:
        console.print(f"timing: {timing.get('pairs')} pairs, reference median "
                      f"{timing['reference'].get('median_ms', 0):.4f} ms, candidate median "
                      f"{timing['candidate'].get('median_ms', 0):.4f} ms, region clean "
                      f"{(timing.get('region') or {}).get('clean')}")


def cmd_history(args: argparse.Namespace) -> int:
    from krex.records import RecordStore

    with RecordStore(args.records) as store:
        if args.action == "show":
            return _show(store, args)
        if args.action == "export":
            return _export(store, args)
        rows = store.rows(args.limit)
    if args.json:
        from krex.cli.output import print_json

        print_json(rows)
        return 0
    from krex.cli.output import table

    table(f"evaluations in {store.path}", ["id", "when", "device", "verdict", "speedup",
                                           "correct", "candidate", "findings"],
          [(r["id"], r["created_at"][:19], r["device"], r["verdict"],
            "" if r["speedup"] is None or r["verdict"] == "invalid" else f"{r['speedup']:.3f}",
            r["correct"],
            r["candidate"].rsplit("/", 1)[-1], " ".join(r["findings"])) for r in rows])
    return 0


def _show(store: Any, args: argparse.Namespace) -> int:
    if not args.id:
        raise BadRequest("krex history show needs an evaluation id", hint="krex history lists ids")
    record = store.get(args.id)
    if record is None:
        raise BadRequest(f"no single evaluation with id {args.id!r} in {store.path}",
                         hint="krex history lists ids; give the whole id or a longer prefix")
    if args.json:
        from krex.cli.output import print_json

        print_json({**record, "regions": store.regions(record["id"])})
    else:
        _print_evaluation(record)
    return 0


def _export(store: Any, args: argparse.Namespace) -> int:
    out = open(args.out, "w", newline="") if args.out else sys.stdout
    try:
        n = store.export_csv(out) if args.format == "csv" else store.export_jsonl(out)
    finally:
        if args.out:
            out.close()
    if args.out:
        print(f"{n} evaluations written to {args.out}", file=sys.stderr)
    return 0
