"""``krex demo`` judges overlap from the jobs' own observations (issue 11, item 7).

Unit: :func:`observed_overlaps` on synthetic traces.  Through a real daemon:
the demo's Python examples run under ``krex.cli.demo_witness`` and report no
region overlap and no sibling running inside a region; the negative control
(a daemon with ``--freeze off``: siblings keep running during regions) finds
siblings running and the demo fails.
"""

from __future__ import annotations

import json

from helpers import Daemon, run_krex

from krex.cli.demo import observed_overlaps


def _trace(regions, beats):
    return {"pid": 1, "regions": regions, "beats": beats}


def test_overlap_from_own_observations():
    quiet = {"a": _trace([[1.0, 2.0]], [0.5, 0.9, 2.1, 3.6]),
             "b": _trace([[2.5, 3.5]], [0.4, 0.6, 2.2, 3.7])}
    assert observed_overlaps(quiet) == {"jobs": 2, "regions": 2, "region_overlaps": 0,
                                        "sibling_ran": 0, "sibling_beats": 0,
                                        "latecomer_beats": 0}
    ran = {"a": _trace([[1.0, 2.0]], [0.5]), "b": _trace([], [0.4, 1.2, 1.3])}
    assert observed_overlaps(ran)["sibling_ran"] == 1
    assert observed_overlaps(ran)["sibling_beats"] == 2
    both = {"a": _trace([[1.0, 2.0]], []), "b": _trace([[1.9, 3.0]], [])}
    assert observed_overlaps(both)["region_overlaps"] == 1
    late = {"a": _trace([[1.0, 2.0]], [0.5]), "b": _trace([], [1.5, 2.5])}
    obs = observed_overlaps(late)
    assert obs["latecomer_beats"] == 1 and obs["sibling_ran"] == 0


def test_demo_explains_every_not_clean_count(capsys):
    """``clean 1/2`` comes with why the other region was not clean."""
    from krex.cli.demo import _show, _summarise

    preempted = "holder_preempted"  # the daemon's region records keep the reasons' codes
    records = [{"job": "t-a", "clean": True, "waited_s": 0.0, "held_s": 0.1, "reasons": []},
               {"job": "t-a", "clean": False, "waited_s": 0.0, "held_s": 0.1,
                "reasons": [preempted]},
               {"job": "t-b", "clean": True, "waited_s": 0.0, "held_s": 0.1, "reasons": []}]
    summary = _summarise(records, {"t-a": 0, "t-b": 0}, "t")
    a, b = summary["jobs"]
    assert a["clean"] == 1 and a["not_clean"] == {preempted: 1}, a
    assert b["not_clean"] == {}, b  # negative control: all clean, nothing to explain
    _show(summary, {})
    out = capsys.readouterr().out
    want = "not clean: a: 1 of 2 regions: holder_preempted (docs/protocol.md, reason codes)"
    assert want in out, out
    assert "not clean: b" not in out


def _demo(runtime_dir, monkeypatch, *serve_args: str, copies: int = 1):
    d = Daemon(str(runtime_dir), *serve_args).start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    try:
        out = run_krex("demo", "--copies", str(copies), "--reps", "3", "--json", timeout=180)
        assert d.proc.poll() is None, "the demo stopped a daemon it did not start"
    finally:
        d.stop()
    return out.returncode, json.loads(out.stdout), out.stderr


def test_demo_jobs_see_no_overlap_and_no_sibling_running(runtime_dir, monkeypatch):
    code, summary, err = _demo(runtime_dir, monkeypatch)
    obs = summary["observed"]
    assert code == 0, (err, summary)
    assert obs["jobs"] == 3 and obs["regions"] >= 9, obs  # the three Python examples
    assert obs["region_overlaps"] == 0 and obs["sibling_ran"] == 0, obs


def test_demo_without_freezing_sees_siblings_running(runtime_dir, monkeypatch):
    """Negative control: the daemon still serialises regions, but siblings are not
    frozen: their heartbeats land inside other jobs' regions, and the demo fails.  Two
    copies of each example: the two compare jobs (regions of up to 0.3 s) are alive
    together whatever the timing of the short examples."""
    code, summary, _ = _demo(runtime_dir, monkeypatch, "--freeze", "off", copies=2)
    obs = summary["observed"]
    assert summary["overlaps"] == 0  # the grant records alone see nothing wrong
    assert obs["sibling_ran"] > 0 and obs["sibling_beats"] > 0, (obs, summary["jobs"])
    assert code == 1
