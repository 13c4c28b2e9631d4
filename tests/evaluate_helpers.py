"""Shared by the krex.evaluate tests: a daemon per module, the gallery's paths."""

from __future__ import annotations

import os

import pytest
from helpers import CONTENTION, Daemon

GALLERY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluate_gallery")
CPU = os.path.join(GALLERY, "cpu")
FAKEGPU = os.path.join(GALLERY, "fakegpu")


def spec(folder: str, text: str) -> str:
    """'file.py:fn' inside a gallery folder."""
    return os.path.join(folder, text)


def module_daemon(tmp_path_factory: pytest.TempPathFactory, *extra: str):
    """Start a private daemon for a whole test module; yields it, stops it after."""
    runtime = tmp_path_factory.mktemp("rt")
    os.chmod(runtime, 0o700)
    yield from serving(Daemon(str(runtime), *extra))


def serving(daemon: Daemon):
    """Start ``daemon`` and point clients at it (``KREX_SOCKET``); yields it, stops it
    after."""
    daemon.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KREX_SOCKET", daemon.socket)
        try:
            yield daemon
        finally:
            daemon.stop()


def abstained_for_contention(ev) -> bool:
    """``unclear`` because krex distrusted its own timing, or set aside the pairs such
    tasks hit and could not tell from the rest, and only for unmanaged tasks on the
    holder's cores (the suite runs with the shield off: other sessions' processes on
    this shared machine may take the holder's core).  An honest abstention, not a wrong
    verdict: a test of something else xfails on it instead of failing."""
    if ev.verdict != "unclear":
        return False
    found = [f for f in ev.findings if f.code.name == "TIMING_UNTRUSTED"]
    if found:
        return set(found[0].evidence.get("disturbed_by") or ()) <= CONTENTION
    # or the pairs such tasks hit were set aside and the rest were too few to tell (a CPU
    # loop beside the suite: "unclear 1.96x [0.66, 2.16]" from what was left)
    screened = [f for f in ev.findings if f.code.name == "TIMING_SCREENED"]
    return bool(screened) and set(screened[0].evidence.get("reasons") or ()) <= CONTENTION


def expect_verdict(ev, verdict: str) -> None:
    """``ev.verdict == verdict``, or an xfail when the timing was disturbed by contention."""
    if ev.verdict != verdict and abstained_for_contention(ev):
        pytest.xfail(f"timing untrusted (unmanaged tasks on the holder's cores): {ev.summary()}")
    assert ev.verdict == verdict, ev.summary()


def verdict_or_abstained(ev, verdict: str) -> bool:
    """For tests of something else (caching, recycling): the verdict, or an honest
    abstention for contention (see :func:`abstained_for_contention`)."""
    return ev.verdict == verdict or abstained_for_contention(ev)


def evaluate_cpu(cand: str, **kw):
    """``krex.evaluate`` of gallery candidate ``cand`` (``file.py:function`` in cpu/)
    against the gallery's reference and inputs; hot cache unless told, nothing saved."""
    import krex

    kw.setdefault("cache", "hot")
    return krex.evaluate(spec(CPU, "kernels.py:reference"), spec(CPU, cand),
                         spec(CPU, "inputs.py:make"), fresh=True, save=False, **kw)
