"""PNG plots made from a results file only (never from a live run).

``plot_all(doc, out_dir)`` writes ``throughput.png`` (measured vs bound per
mode), ``inflation_cdf.png`` (one panel per kernel-duration bucket, one CDF
per mode) and ``timeline.png`` (exclusive regions per device over time, one
row per mode's first block).  Needs matplotlib (``pip install 'krex[plot]'``);
without it, returns an empty list and the reason.
"""

from __future__ import annotations

import os
from typing import Any

from krex.eval.metrics import inflations


def available() -> str | None:
    """None when matplotlib can be used, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        return None
    except ImportError:
        return "matplotlib is not installed (pip install 'krex[plot]'): PNGs skipped"


def plot_all(doc: dict[str, Any], out_dir: str) -> tuple[list[str], str | None]:
    why = available()
    if why:
        return [], why
    os.makedirs(out_dir, exist_ok=True)
    paths = [_throughput(doc, out_dir), _cdf(doc, out_dir), _timeline(doc, out_dir)]
    return paths, None


def _throughput(doc: dict[str, Any], out_dir: str) -> str:
    import matplotlib.pyplot as plt

    modes = list(doc["summary"])
    measured = [doc["summary"][m]["throughput_cpm"] for m in modes]
    bound = [doc["bound"]["per_mode_cpm"].get(m, 0.0) for m in modes]
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], bound, 0.4, label="ideal bound", alpha=0.5)
    ax.set_xticks(list(xs), modes, rotation=30, ha="right")
    ax.set_ylabel("commands / min")
    ax.set_title(f"throughput on {doc['device']}, {doc['agents']} agents")
    ax.legend()
    return _save(fig, out_dir, "throughput.png")


def _cdf(doc: dict[str, Any], out_dir: str) -> str:
    import matplotlib.pyplot as plt

    buckets = doc["profile"]["buckets_ms"]
    fig, axes = plt.subplots(1, len(buckets), figsize=(4 * len(buckets), 3.6), squeeze=False)
    for ax, b in zip(axes[0], buckets, strict=True):
        for mode in doc["summary"]:
            vals = sorted(r["inflation_pct"] for blk in doc["blocks"] if blk["mode"] == mode
                          for r in inflations(blk) if r["bucket_ms"] == b)
            if vals:
                ys = [(i + 1) / len(vals) for i in range(len(vals))]
                ax.step(vals, ys, where="post", label=mode)
        ax.set_title(f"kernels ≥ {b:g} ms")
        ax.set_xlabel("inflation vs alone (%)")
        ax.set_xscale("symlog", linthresh=1.0)
    axes[0][0].set_ylabel("fraction of timed kernels")
    axes[0][-1].legend(fontsize=7)
    return _save(fig, out_dir, "inflation_cdf.png")


def _timeline(doc: dict[str, Any], out_dir: str) -> str:
    import matplotlib.pyplot as plt

    firsts: dict[str, dict[str, Any]] = {}
    for blk in doc["blocks"]:
        firsts.setdefault(blk["mode"], blk)
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(firsts)))
    for row, blk in enumerate(firsts.values()):
        t0 = blk["start_mono_s"]
        spans = [(r["granted_mono_s"] - t0, r["held_s"]) for r in blk["regions"]
                 if not r.get("nested") and r["granted_mono_s"] >= t0]
        ax.broken_barh(spans, (row - 0.4, 0.8))
    ax.set_yticks(range(len(firsts)), list(firsts))
    ax.set_xlabel("s since block start")
    ax.set_title(f"regions held on {doc['device']} (first block of each mode)")
    return _save(fig, out_dir, "timeline.png")


def _save(fig: Any, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
