"""40 KernelBench solutions to 8 problems, three ways side by side (issue 46).

The problems and solutions are generated with known truth.  Each problem's
``Model`` computes an elementwise or row-wise function ``f`` twice (the
second result is the one returned), so five solutions are known by
construction: ``fast`` computes ``f`` once (faster, about 2x), ``slow``
computes it four times (slower, about 0.5x), ``same`` is the problem's own
code (same), ``wrong`` adds 1e-2 (invalid: ``WRONG_OUTPUT``) and ``cached``
returns its first answer for an input tensor again (invalid: ``STALE_OUTPUT``).

Three ways, each on a private daemon of its own, one after another in one run:

- ``serial``: ``krex kernelbench run --jobs 1`` -- one evaluation at a time,
  the device its own all along (what a serial harness does);
- ``krex``: ``krex kernelbench run --jobs N`` -- loading and correctness side
  by side, each timing in a region alone on the device;
- ``no enforcement``: the same ``--jobs N`` against a daemon that grants its
  regions one at a time but stops nothing (``--freeze off --no-isolate
  --no-gate``): the other evaluations' work runs beside each timing.

It reports solutions per minute and each way's verdicts against the truth: a
``faster``/``slower``/``same`` solution must get that verdict, a wrong or cached
one ``invalid``; ``unclear`` is counted apart (an abstention, not a right answer).

    .venv/bin/python benchmarks/bench_kernelbench.py [--jobs 4] [--out F]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import md_table, private_daemon, write_results

# name -> (f of a tensor x, the inputs' shape): each about a millisecond on one core
FUNCTIONS = {
    "1_Softplus": ("torch.log1p(torch.exp(x))", (512, 1024)),
    "2_GELU": ("0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))",
               (512, 1024)),
    "3_SiLU": ("x * torch.sigmoid(x)", (512, 1024)),
    "4_Softmax": ("torch.softmax(x, dim=1)", (512, 1024)),
    "5_LayerNorm": ("(x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-5)",
                    (512, 1024)),
    "6_LogSumExp": ("torch.logsumexp(x, dim=1)", (512, 1024)),
    "7_Cumsum": ("torch.cumsum(x, dim=1)", (256, 1024)),
    "8_Tanh_Scale": ("torch.tanh(x) * 2.0 + 1.0", (512, 1024)),
}
TRUTH = {"fast": "faster", "slow": "slower", "same": "same", "wrong": "invalid",
         "cached": "invalid"}

PROBLEM = '''import torch


class Model(torch.nn.Module):
    def forward(self, x):
        y = {f}
        x = x + 0  # the second pass: the one returned
        return {f}


def get_inputs():
    return [torch.randn{shape}]


def get_init_inputs():
    return []
'''

SOLUTIONS = {
    "fast": "        return {f}\n",
    "slow": "        for _ in range(3):\n            y = {f}\n        return {f}\n",
    "same": "        y = {f}\n        x = x + 0\n        return {f}\n",
    "wrong": "        return {f} + 1e-2\n",
    "cached": ("        key = (x.data_ptr(), tuple(x.shape))\n"
               "        if key not in self.seen:\n"
               "            self.seen[key] = {f}\n"
               "        return self.seen[key]\n"),
}
SOLUTION = '''import torch


class ModelNew(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = {{}}

    def forward(self, x):
{body}'''

WAYS = {"serial": ((), 1), "krex": ((), None),
        "no enforcement": (("--freeze", "off", "--no-isolate", "--no-gate"), None)}


def generate(folder: str) -> dict[str, str]:
    """The problems and solutions; solution file name -> its truth."""
    problems, solutions = os.path.join(folder, "problems"), os.path.join(folder, "solutions")
    os.makedirs(problems)
    os.makedirs(solutions)
    truth = {}
    for name, (f, shape) in FUNCTIONS.items():
        with open(os.path.join(problems, f"{name}.py"), "w") as out:
            out.write(PROBLEM.format(f=f, shape=shape))
        for kind, body in SOLUTIONS.items():
            with open(os.path.join(solutions, f"{name}_{kind}.py"), "w") as out:
                out.write(SOLUTION.format(body=body.format(f=f)))
            truth[f"{name}_{kind}.py"] = TRUTH[kind]
    return truth


def one_way(way: str, flags: tuple[str, ...], jobs: int, folder: str,
            args: argparse.Namespace) -> dict[str, Any]:
    out = os.path.join(folder, "out-" + way.replace(" ", "-"))
    env = {**os.environ, "XDG_CACHE_HOME": os.path.join(folder, "cache-" + way[:6])}
    with private_daemon(*flags) as sock:
        env["KREX_SOCKET"] = sock
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "krex", "kernelbench", "run", "--problems",
             os.path.join(folder, "problems"), "--solutions", os.path.join(folder, "solutions"),
             "--out", out, "--jobs", str(jobs), "--seeds", str(args.seeds), "--cache", "hot",
             "--records", os.path.join(folder, f"records-{way[:6]}.sqlite3"), "--json"],
            env=env, capture_output=True, text=True, timeout=3600)
        wall_s = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{way}: krex kernelbench run failed: {proc.stderr[-3000:]}")
    return {"wall_s": wall_s, **json.loads(proc.stdout)}


def score(outcomes: list[dict[str, Any]], truth: dict[str, str]) -> dict[str, Any]:
    right, unclear, wrong = 0, 0, []
    confusion: collections.Counter[str] = collections.Counter()
    for o in outcomes:
        want, got = truth[o["solution"]], o["verdict"]
        confusion[f"{want}->{got}"] += 1
        if got == want:
            right += 1
        elif got == "unclear":
            unclear += 1
        else:
            wrong.append(f"{o['solution']}: {got} (speedup {o.get('speedup')})")
    return {"right": right, "unclear": unclear, "wrong": len(wrong), "wrong_list": wrong,
            "confusion": dict(sorted(confusion.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4, help="evaluations at once (krex, none)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", help="results file (default results/bench_kernelbench.json)")
    args = ap.parse_args()
    rows, res = [], {"jobs": args.jobs, "ways": {}}
    with tempfile.TemporaryDirectory(prefix="krex-bench-kb-") as folder:
        truth = generate(folder)
        res["solutions"], res["problems"] = len(truth), len(FUNCTIONS)
        for way, (flags, jobs) in WAYS.items():
            run = one_way(way, flags, jobs or args.jobs, folder, args)
            s = score(run["outcomes"], truth)
            per_min = len(run["outcomes"]) / run["wall_s"] * 60
            res["ways"][way] = {"wall_s": round(run["wall_s"], 1),
                                "solutions_per_min": round(per_min, 2), **s,
                                "outcomes": run["outcomes"]}
            print(f"{way}: {per_min:.1f} solutions/min, {s['right']}/{len(truth)} right, "
                  f"{s['unclear']} unclear, {s['wrong']} wrong: {s['wrong_list']}",
                  file=sys.stderr, flush=True)
    serial = res["ways"]["serial"]["solutions_per_min"]
    for way, r in res["ways"].items():
        rows.append([way, r["solutions_per_min"], f"{r['solutions_per_min'] / serial:.2f}",
                     f"{r['right']}/{res['solutions']}", r["unclear"], r["wrong"]])
    table = md_table(["way", "solutions/min", "x serial", "right", "unclear", "wrong"], rows)
    res["table"] = table
    print(table)
    print("wrote", write_results("bench_kernelbench", res, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
