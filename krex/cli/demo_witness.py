"""Run one ``krex demo`` example and record what it saw itself (``krex demo``'s witness).

``python -m krex.cli.demo_witness TRACE.json EXAMPLE.py ARGS...`` runs the
example (``runpy``) with two of its own observers, and writes TRACE.json
when it ends: ``regions``, the ``[t_in, t_out]`` of every top-level region
this process held, taken by its own clock (``time.monotonic``) right after
the grant and right before the release; and ``beats``, the times a
heartbeat thread of this process ran (every ~2 ms).  :mod:`krex.cli.demo`
judges overlap from these, not from the daemon's grant records: two jobs'
regions that intersect, or a beat of one job inside another's region (a
sibling that ran while it should have been frozen).
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time

from krex import resultfile

BEAT_S = 0.002


class Witness:
    def __init__(self) -> None:
        self.regions: list[list[float]] = []
        self.beats: list[float] = []
        self._open: dict[int, float] = {}
        self._stop = threading.Event()

    def beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            self.beats.append(time.monotonic())

    def watch_regions(self) -> None:
        from krex.client.region import Region

        enter, leave = Region.__enter__, Region.__exit__
        witness = self

        def __enter__(self: Region) -> Region:  # noqa: N807 - the patched dunder
            out = enter(self)
            if not self._nested and not (self.grant or {}).get("nested"):
                witness._open[id(self)] = time.monotonic()
            return out

        def __exit__(self: Region, *exc: object) -> None:  # noqa: N807
            t_in = witness._open.pop(id(self), None)
            if t_in is not None:
                witness.regions.append([t_in, time.monotonic()])
            leave(self, *exc)

        Region.__enter__, Region.__exit__ = __enter__, __exit__  # type: ignore[method-assign]

    def write(self, path: str) -> None:
        self._stop.set()
        resultfile.write(path, {"pid": os.getpid(), "regions": self.regions,
                                "beats": self.beats}, indent=None)


def main(argv: list[str]) -> int:
    trace, example, *args = argv
    witness = Witness()
    witness.watch_regions()
    threading.Thread(target=witness.beat, daemon=True).start()
    sys.argv = [example, *args]
    try:
        runpy.run_path(example, run_name="__main__")
    finally:
        witness.write(trace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
