"""The worker process: ``python -m krex.workers.worker --fd N``.

Spawned by the pool, never forked.  In: an ``init`` message (device,
preload, options, output sentinel), then ``run`` messages.  Out: ``ready``
(what was initialised and how long it took), then one ``done`` per program
(the runner's result plus ``recycle`` — why this worker must not serve
again — and ``restored``).  Program output goes to fds 1 and 2, which are
pipes the pool reads; after each program the worker writes the sentinel on
both so the pool knows it has all of the output.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import io
import os
import socket
import sys
import time
from typing import Any

from krex.workers import canary, runner, snapshot
from krex.workers.channel import Channel, ChannelClosed
from krex.workers.context import open_context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m krex.workers.worker")
    parser.add_argument("--fd", type=int, required=True, help="the pool's socket")
    opts = parser.parse_args(argv)
    channel = Channel(socket.socket(fileno=opts.fd))
    _setup_streams()
    try:
        init = channel.recv()
        Worker(channel, init).serve()
    except ChannelClosed:
        return 0
    return 0


def _setup_streams() -> None:
    """Unbuffered text streams on fds 1 and 2, so output reaches the pool live."""
    sys.stdout = _stream(1)
    sys.stderr = _stream(2)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]
    faulthandler.enable(file=sys.stderr, all_threads=True)


def _stream(fd: int) -> io.TextIOWrapper:
    """Line-buffered, like a terminal: each complete line reaches the pool at once."""
    buffered = io.BufferedWriter(io.FileIO(fd, "w", closefd=False))
    return io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace",
                            line_buffering=True)


class Worker:
    def __init__(self, channel: Channel, init: dict[str, Any]) -> None:
        self.channel = channel
        self.options = init
        self.sentinel = init["sentinel"]
        self.served = 0
        t0 = time.monotonic()
        try:
            self.context = open_context(init["device"])
        except Exception as e:
            channel.send({"t": "failed", "error": f"{type(e).__name__}: {e}"})
            raise SystemExit(3) from e
        t1 = time.monotonic()
        loaded, missing = _preload(init.get("preload", []))
        missing.update(_preload(list(KREX_PRELOAD))[1])  # krex's own: reported when missing
        _preload([n for n in LIBRARY_PRELOAD if n.split(".")[0] in sys.modules or "." not in n])
        self.memory_cap = _apply_memory_cap(init["device"])
        t2 = time.monotonic()
        self._warm_up()
        self.snap = snapshot.take()
        self.canary = canary.Canary.take(self.context)
        channel.send({"t": "ready", "pid": os.getpid(), "context": self.context.info,
                      "context_s": t1 - t0, "preload_s": t2 - t1, "preloaded": loaded,
                      "missing": missing, "memory_cap": self.memory_cap})

    def _warm_up(self) -> None:
        """Run one empty program so lazy initialisation is part of the baseline."""
        request = {"kind": "callable", "payload": _NOOP, "cwd": os.getcwd(), "args": [],
                   "env": dict(os.environ)}
        runner.run(request, dict(os.environ), [])
        self._end_of_output()

    def serve(self) -> None:
        while True:
            message = self.channel.recv()
            if message.get("t") == "run":
                self.channel.send(self.run(message))

    def run(self, message: dict[str, Any]) -> dict[str, Any]:
        result = runner.run(message["request"], self.snap.environ,
                            self.options.get("pinned_env", []))
        self._end_of_output()
        _release_left_open()
        restored = [x for x in snapshot.restore(self.snap) if x not in _APPLIED_BY_RUNNER]
        self.served += 1
        failed = [x for x in restored if snapshot.RESTORE_FAILED in x]
        try:
            reason = canary.verdict(self.canary, self.context,
                                    self.options.get("memory_growth_limit_mb", 512.0),
                                    self.options.get("check_libraries", True))
        except Exception as e:  # noqa: BLE001  (a worker that cannot check itself is unfit)
            reason = f"check_failed: {type(e).__name__}: {e}"
        if failed and not reason:  # state this worker could not put back
            reason = "restore_failed: " + ", ".join(failed[:3])
        return {"t": "done", "seq": message["seq"], "result": result, "recycle": reason,
                "restored": restored}

    def _end_of_output(self) -> None:
        for fd in (1, 2):
            os.write(fd, self.sentinel)


def _release_left_open() -> None:
    """A region the program left open ends with it (krex.client's connection is closed);
    else the next program here waited for the daemon to revoke it at its maximum hold."""
    region = sys.modules.get("krex.client.region")
    if region is not None:
        try:
            region.close_if_held()
        except Exception:  # noqa: BLE001, S110  (the daemon still revokes it in the end)
            pass


# What the runner itself sets for every program: putting it back is no news.
_APPLIED_BY_RUNNER = {"process:cwd", "process:environ", "sys:path", "sys:argv"}


def _apply_memory_cap(device: str) -> dict[str, object] | None:
    """The device memory cap of this worker and what enforces it."""
    cap = os.environ.get("KREX_DEVICE_MEMORY_CAP_MB")
    if not cap:
        return None
    kind, _, index = device.partition(":")
    if kind == "fakegpu":
        return {"mb": int(cap), "enforced_by": "fakegpu driver"}
    torch = sys.modules.get("torch")
    if kind == "cuda" and torch is not None and torch.cuda.is_available():
        ordinal = int(index or 0)
        total = torch.cuda.get_device_properties(ordinal).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, int(cap) * 2**20 / total), ordinal)
        return {"mb": int(cap), "enforced_by": "torch caching allocator"}
    return {"mb": int(cap), "enforced_by": None,
            "why": "no per-process device memory cap on this backend (preload torch on cuda)"}


# krex's own modules that programs run in a worker use (krex.measure; krex.evaluate's
# program): loaded before the snapshot, they are not imported again for every program
# (~100 ms on a busy 2-core machine), their globals are put back after each program like
# numpy's, and the canary recycles a worker whose krex functions or classes a program
# replaced (``krex_modified``).  Not krex.client: its connection and region state belong
# to one program (a region a program left open must not be the next one's) — but the
# stateless modules it imports are (the protocol's message classes alone cost ~17 ms to
# create): with them ``import krex.client.region`` takes 15 ms instead of 70 (quiet).
KREX_PRELOAD = ("krex.measure", "krex.evaluate.worker", "krex.protocol.messages",
                "krex.protocol.framing", "krex.protocol.address", "krex.protocol.installation",
                "krex.protocol.liveness", "krex.devices.discovery", "krex.workers.spec")
# Parts every evaluation imported again (numpy's random generators for the inputs,
# zipfile for the outputs' files): loaded when their package already is (a worker
# without numpy stays without it), never reported missing.
LIBRARY_PRELOAD = ("numpy.random", "zipfile", "base64")


def _preload(names: list[str]) -> tuple[list[str], dict[str, str]]:
    loaded, missing = [], {}
    for name in names:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as e:  # noqa: BLE001  (a missing module is recorded, not fatal)
            missing[name] = f"{type(e).__name__}: {e}"
    return loaded, missing


_NOOP = __import__("pickle").dumps((int, (), {}))  # a program that does nothing

if __name__ == "__main__":
    raise SystemExit(main())
