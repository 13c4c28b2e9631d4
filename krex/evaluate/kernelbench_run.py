"""A folder of KernelBench solutions, evaluated concurrently (``krex kernelbench run``).

In: a problems folder (``19_ReLU.py``, ...), a solutions folder and optionally a
manifest.  Each solution is matched to its problem (:func:`pairs`): by the
manifest; else by name -- the problem's file name begins the solution's
(``19_ReLU_fused.py``), or the solution names the problem's number as
KernelBench's own scripts do (``level_1_problem_19_sample_0_kernel.py``), or
begins with it (``19_mine.py``).  Out: one :class:`Outcome` per solution,
appended to ``results.jsonl`` in the output folder the moment it is known (no
lost work), ``results.csv`` rewritten from it at the end, and a table per
problem.

Each solution is :func:`krex.evaluate.kernelbench.evaluate`'s, ``jobs`` at once:
their imports, loading and correctness run side by side in the daemon's warm
workers, and only each one's timing is exclusive (its region).  A solution that
does not load, hangs past ``timeout_s`` or crashes its worker is a verdict of
its own (``invalid``, with the finding); a failure of krex itself (no daemon)
is an error of the run.  The run resumes: a solution whose problem, solution and
options hash as an outcome already in ``results.jsonl`` is not evaluated again.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from krex.errors import BadRequest, KrexError

RESULTS, TABLE = "results.jsonl", "results.csv"
NUMBERED = (re.compile(r"problem_?(\d+)"), re.compile(r"^(\d+)(?:_|$)"))


@dataclass(frozen=True)
class Pair:
    problem: str  # paths
    solution: str

    def key(self, options: dict[str, Any]) -> str:
        """Both files' contents and the options: what a resumed run compares."""
        h = hashlib.sha256()
        for path in (self.problem, self.solution):
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        h.update(json.dumps(options, sort_keys=True).encode())
        return h.hexdigest()[:24]


@dataclass
class Outcome:
    """One solution's verdict, as results.jsonl and results.csv hold it."""

    problem: str  # file names
    solution: str
    key: str
    verdict: str  # faster | slower | same | unclear | invalid | error (krex's own failure)
    correct: bool | None = None
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    findings: list[str] = field(default_factory=list)  # codes
    record_id: str | None = None
    status: str | None = None  # the candidate program's: ok, timeout, crashed, ...
    error: str | None = None  # krex's own failure, or why the solution was refused
    elapsed_s: float = 0.0

    @classmethod
    def of(cls, pair: Pair, key: str, ev: Any, elapsed_s: float) -> Outcome:
        return cls(problem=os.path.basename(pair.problem),
                   solution=os.path.basename(pair.solution), key=key, verdict=ev.verdict,
                   correct=ev.correct, speedup=ev.speedup, ci_low=ev.ci_low,
                   ci_high=ev.ci_high, findings=ev.codes(), record_id=ev.id,
                   status=ev.status, elapsed_s=round(elapsed_s, 3))

    @classmethod
    def failed(cls, pair: Pair, key: str, verdict: str, why: str,
               elapsed_s: float) -> Outcome:
        return cls(problem=os.path.basename(pair.problem),
                   solution=os.path.basename(pair.solution), key=key, verdict=verdict,
                   correct=False if verdict == "invalid" else None, error=why,
                   elapsed_s=round(elapsed_s, 3))


@dataclass
class Run:
    """What one ``krex kernelbench run`` did."""

    outcomes: list[Outcome]  # every solution's: this run's and earlier runs' (resumed)
    evaluated: int
    resumed: int
    unmatched: list[tuple[str, str]]  # (solution, why)
    elapsed_s: float

    @property
    def errors(self) -> int:
        return sum(o.verdict == "error" for o in self.outcomes)


def pairs(problems: str, solutions: str, manifest: str | None = None
          ) -> tuple[list[Pair], list[tuple[str, str]]]:
    """Each solution with its problem, and the solutions with none (and why)."""
    probs = _files(problems, "problems")
    sols = _files(solutions, "solutions")
    mapped = _manifest(manifest, problems, solutions) if manifest else {}
    out, unmatched = [], []
    for sol in sols:
        if manifest:
            prob = mapped.get(sol)
            why = "the manifest names no problem for it" if prob is None else \
                f"its problem {prob} does not exist"
        else:
            prob = _match(sol, probs)
            why = "no problem's name or number matches its name (or more than one does)"
        if prob is not None and os.path.isfile(prob):
            out.append(Pair(prob, sol))
        else:
            unmatched.append((os.path.basename(sol), why))
    return out, unmatched


def run(todo: list[Pair], out_dir: str, *, device: str = "cpu", jobs: int = 2,
        options: dict[str, Any] | None = None,
        on_done: Callable[[Outcome, int, int], None] | None = None,
        unmatched: Iterable[tuple[str, str]] = ()) -> Run:
    """Evaluate every pair not already in ``out_dir/results.jsonl``, ``jobs`` at once."""
    from krex.evaluate import kernelbench

    if jobs < 1:
        raise BadRequest("--jobs must be at least 1", hint="e.g. --jobs 4")
    options = {"device": device, **(options or {})}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, RESULTS)
    done = {o.key: o for o in _read(path)}
    keyed = [(p, p.key(options)) for p in todo]
    fresh = [(p, k) for p, k in keyed if k not in done]
    lock, t0, count = threading.Lock(), time.monotonic(), [0]

    def one(pair: Pair, key: str) -> Outcome:
        start = time.monotonic()
        try:
            ev = kernelbench.evaluate(pair.problem, pair.solution,
                                      label=f"kernelbench {os.path.basename(pair.solution)}",
                                      **options)
            outcome = Outcome.of(pair, key, ev, time.monotonic() - start)
        except BadRequest as exc:  # a solution without ModelNew: refused before it ran
            outcome = Outcome.failed(pair, key, "invalid", exc.message,
                                     time.monotonic() - start)
        except KrexError as exc:  # krex's own failure: the run's error, tried again later
            outcome = Outcome.failed(pair, key, "error", f"{exc.code}: {exc.message}",
                                     time.monotonic() - start)
        with lock:
            if outcome.verdict != "error":  # kept: a resumed run does not take it again
                _append(path, outcome)
            count[0] += 1
            if on_done is not None:
                on_done(outcome, count[0], len(fresh))
        return outcome

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="krex-kb") as pool:
        new = list(pool.map(lambda pk: one(*pk), fresh))
    by_key = {**done, **{o.key: o for o in new}}
    outcomes = [by_key[k] for _, k in keyed]
    _write_csv(os.path.join(out_dir, TABLE), outcomes)
    return Run(outcomes, evaluated=len(fresh), resumed=len(keyed) - len(fresh),
               unmatched=list(unmatched), elapsed_s=time.monotonic() - t0)


# -- matching --------------------------------------------------------------------------

def _files(folder: str, what: str) -> list[str]:
    if not os.path.isdir(folder):
        raise BadRequest(f"the {what} folder {folder} does not exist",
                         hint=f"--{what} DIR: a folder of KernelBench .py files")
    found = sorted(os.path.join(os.path.abspath(folder), n) for n in os.listdir(folder)
                   if n.endswith(".py") and not n.startswith(("_", ".")))
    if not found:
        raise BadRequest(f"the {what} folder {folder} has no .py files",
                         hint="KernelBench problems are files like 19_ReLU.py")
    return found


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _match(solution: str, problems: list[str]) -> str | None:
    """The problem ``solution`` names, or None; a tie is no match."""
    stem = _stem(solution)
    by_name = [p for p in problems if stem == _stem(p) or stem.startswith(_stem(p) + "_")]
    if by_name:
        return max(by_name, key=lambda p: len(_stem(p)))  # 1_Softplus_2 over 1_Softplus
    for pattern in NUMBERED:
        m = pattern.search(stem)
        if m:
            numbered = [p for p in problems if re.match(rf"{int(m.group(1))}_", _stem(p))]
            return numbered[0] if len(numbered) == 1 else None
    return None


def _manifest(path: str, problems: str, solutions: str) -> dict[str, str]:
    """``{"solution.py": "problem.py"}`` (JSON) or ``solution.py,problem.py`` lines (CSV),
    each relative to its folder."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise BadRequest(f"cannot read the manifest {path}: {exc.strerror}",
                         hint="--manifest FILE: JSON {solution: problem} or CSV lines") \
            from None
    try:
        rows = list(json.loads(text).items())
    except (ValueError, AttributeError):
        rows = [tuple(r[:2]) for r in csv.reader(text.splitlines()) if len(r) >= 2
                and not r[0].startswith("#")]
    return {os.path.abspath(os.path.join(solutions, s.strip())):
            os.path.abspath(os.path.join(problems, p.strip())) for s, p in rows}


# -- results ---------------------------------------------------------------------------

def _read(path: str) -> list[Outcome]:
    names = {f.name for f in fields(Outcome)}
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    data = json.loads(line)
                    out.append(Outcome(**{k: v for k, v in data.items() if k in names}))
                except (ValueError, TypeError):
                    continue  # a line cut by a killed run: that solution runs again
    except FileNotFoundError:
        pass
    return out


def _append(path: str, outcome: Outcome) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(asdict(outcome)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_csv(path: str, outcomes: list[Outcome]) -> None:
    names = [f.name for f in fields(Outcome)]
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for o in outcomes:
            w.writerow({**asdict(o), "findings": " ".join(o.findings)})
    os.replace(tmp, path)
