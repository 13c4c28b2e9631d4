"""One eval end to end: run, summarise, bound, write results / table / plots.

``evaluate(cfg, out_dir)`` -> (results path, document).  Files in ``out_dir``:
``eval-<device>.json`` (the results file), ``eval-<device>.md`` (the table),
``eval-<device>-*.png`` when matplotlib is installed.  ``report(path)``
remakes the table and plots from a results file.
"""

from __future__ import annotations

import os
from typing import Any

from krex.eval import bound as bd
from krex.eval import metrics, plots, results
from krex.eval.runner import EvalConfig, Progress, run_eval


def _stem(device: str) -> str:
    return "eval-" + device.replace(":", "")


def evaluate(cfg: EvalConfig, out_dir: str, command: str | None = None,
             progress: Progress | None = None) -> tuple[str, dict[str, Any]]:
    raw = run_eval(cfg, progress)
    names = [m.name for m in cfg.modes]
    summary = metrics.summarise(raw, names)
    bound = bd.bounds(raw["alone"], cfg.device, cfg.profile.ctx_delay_ms, names,
                      os.cpu_count() or 1)
    meta = {"device": cfg.device, "agents": cfg.agents, "commands": cfg.commands,
            "rounds": cfg.rounds, "modes": names, "profile": cfg.profile.to_dict(),
            "stagger": cfg.stagger, "command": command}
    doc = results.document(raw, summary, bound, meta)
    path = results.write(doc, os.path.join(out_dir, _stem(cfg.device) + ".json"))
    report(path)
    return path, doc


def recompute(doc: dict[str, Any]) -> dict[str, Any]:
    """Summary and bound again from the raw blocks of a results file (same code as a run)."""
    names = list(doc["modes"])
    doc["summary"] = metrics.summarise(doc, names)
    doc["bound"] = bd.bounds(doc["alone"], doc["device"], doc["profile"]["ctx_delay_ms"], names,
                             doc["machine"]["cpus"] or 1)
    return doc


def report(path: str, refresh: bool = False) -> dict[str, Any]:
    """Table (markdown) and plots from the results file at ``path``; ``refresh``
    first recomputes its summary and bound from its raw blocks and rewrites it."""
    doc = results.load(path)
    if refresh:
        results.write(recompute(doc), path)
    base = os.path.splitext(path)[0]
    with open(base + ".md", "w") as f:
        f.write(results.markdown(doc))
    pngs, why = plots.plot_all(doc, os.path.dirname(os.path.abspath(path)))
    renamed = []
    for p in pngs:
        target = f"{base}-{os.path.basename(p)}"
        os.replace(p, target)
        renamed.append(target)
    return {"table": base + ".md", "plots": renamed, "plots_skipped": why}
