"""``krex kernelbench run``: a folder of KernelBench solutions, concurrently."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_kernelbench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernelbench", help="evaluate a folder of KernelBench solutions",
                       description="KernelBench's format: problems (Model, get_inputs, "
                                   "get_init_inputs) and solutions (ModelNew).")
    ksub = p.add_subparsers(dest="kernelbench_command", metavar="ACTION")
    ksub.required = True
    r = ksub.add_parser(
        "run", help="evaluate every solution of a folder against its problem",
        description="Match each solution to its problem (by the manifest, else by name: "
                    "19_ReLU_x.py or level_1_problem_19_sample_0_kernel.py -> 19_ReLU.py), "
                    "evaluate them --jobs at once (loading and correctness side by side, "
                    "each one's timing in a region of its own), append each verdict to "
                    "OUT/results.jsonl as it comes, and print a table per problem.  A run "
                    "resumes: solutions already in results.jsonl with the same files and "
                    "options are not evaluated again.  Exit 1 only on krex's own errors.")
    r.add_argument("--problems", required=True, metavar="DIR", help="the problems' folder")
    r.add_argument("--solutions", required=True, metavar="DIR", help="the solutions' folder")
    r.add_argument("--manifest", metavar="FILE",
                   help="which problem each solution is for: JSON {solution: problem} or "
                        "CSV lines solution,problem (file names in their folders)")
    r.add_argument("--out", default="krex-kernelbench", metavar="DIR",
                   help="results.jsonl and results.csv go here (default ./krex-kernelbench)")
    r.add_argument("--device", default="cpu", help="cpu (default); fakegpu:N")
    r.add_argument("--jobs", type=int, default=4, help="evaluations at once (default 4)")
    r.add_argument("--seeds", type=int, default=3, help="correctness seeds (default 3)")
    r.add_argument("--cache", choices=("cold", "hot"), default="cold",
                   help="flush caches between timed calls (default cold)")
    r.add_argument("--timeout-s", type=float, default=120.0,
                   help="a solution's whole run; one that hangs past it is TIMEOUT")
    r.add_argument("--records", help="records database (default as for krex evaluate)")
    r.add_argument("--json", action="store_true", help="print every outcome as JSON")
    r.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from krex.evaluate import kernelbench_run as kb

    todo, unmatched = kb.pairs(args.problems, args.solutions, args.manifest)
    for name, why in unmatched:
        print(f"krex: {name}: not evaluated: {why}", file=sys.stderr)
    options: dict[str, Any] = {"seeds": args.seeds, "cache": args.cache,
                               "timeout_s": args.timeout_s}
    if args.records:
        options["records"] = args.records

    def progress(o: kb.Outcome, i: int, n: int) -> None:
        print(f"[{i}/{n}] {o.solution}: {_verdict(o)} ({o.elapsed_s:.1f} s)",
              file=sys.stderr, flush=True)

    result = kb.run(todo, args.out, device=args.device, jobs=args.jobs, options=options,
                    on_done=progress, unmatched=unmatched)
    if args.json:
        from dataclasses import asdict

        from krex.cli.output import print_json

        print_json({"outcomes": [asdict(o) for o in result.outcomes],
                    "evaluated": result.evaluated, "resumed": result.resumed,
                    "unmatched": [{"solution": s, "why": w} for s, w in result.unmatched],
                    "errors": result.errors, "out": args.out})
    else:
        _tables(result.outcomes)
        print(f"{len(result.outcomes)} solutions: {result.evaluated} evaluated, "
              f"{result.resumed} already in {args.out}/results.jsonl, "
              f"{len(result.unmatched)} unmatched, {result.errors} errors of krex "
              f"({result.elapsed_s:.1f} s); results: {args.out}/results.jsonl, "
              f"{args.out}/results.csv")
    return 1 if result.errors else 0


def _verdict(o: Any) -> str:
    if o.verdict == "error":
        return f"error: {o.error}"
    speed = "" if o.speedup is None or o.verdict == "invalid" else \
        f" {o.speedup:.2f}x [{o.ci_low:.2f}, {o.ci_high:.2f}]"
    why = f" ({' '.join(o.findings) or o.error})" if o.verdict == "invalid" else ""
    return f"{o.verdict}{speed}{why}"


def _tables(outcomes: list[Any]) -> None:
    from krex.cli.output import table

    for problem in sorted({o.problem for o in outcomes}):
        table(problem, ["solution", "correct", "verdict", "speedup [99% CI]", "findings",
                        "record"],
              [(o.solution, o.correct, o.verdict,
                "" if o.speedup is None or o.verdict == "invalid"
                else f"{o.speedup:.2f}x [{o.ci_low:.2f}, {o.ci_high:.2f}]",
                " ".join(o.findings) or (o.error or "")[:60], o.record_id or "")
               for o in outcomes if o.problem == problem])
