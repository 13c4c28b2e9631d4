"""The trusted driver's end of the sealed call loop (native/dispatch/dispatch.c).

A :class:`Block` is the shared memory between the driver and one callee process (a
memfd: the callee maps it from C and closes its descriptor, so no Python object there
holds it).  :meth:`Block.call` runs one call -- the callee's function on an argument
set, or the empty call -- and returns a :class:`CallRecord`: both timestamps from this
process's CLOCK_MONOTONIC, taken in C around the publication of the request and the
sight of its completion.  :meth:`Block.output` reads what the callee's dispatcher copied
as part of the call: exact numpy arrays' bytes (tensors as their host arrays), exact
tuples, lists and str-keyed dicts, None/bool/int/float -- as a JSON structure and raw
bytes, never a pickle.  Anything else was refused in the callee: :class:`BadOutput`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any

from krex._native import _dispatch  # type: ignore[attr-defined]

OP_CALL, OP_EMPTY, OP_EXIT, OP_REFILL = 0, 1, 2, 3
W_DONE, W_IN_FLIGHT, W_NOT_READY = 0, 1, 2
STATUS = {0: "ok", 1: "raised", 2: "bad_output", 3: "too_large", 5: "internal"}
CTL = struct.Struct("<IIIIiiiiIIIIQQ")  # ctl_t in dispatch.c
LAYOUT = _dispatch.layout()
SLICE_S = 0.25  # a wait in flight is cut in slices: between them the callee's life is checked
FORMATS = {"?": "bool", "b": "int8", "B": "uint8", "h": "int16", "H": "uint16", "i": "int32",
           "I": "uint32", "l": "int64", "L": "uint64", "q": "int64", "Q": "uint64",
           "e": "float16", "f": "float32", "d": "float64", "Zf": "complex64",
           "Zd": "complex128"}  # PEP 3118 codes of plain numeric dtypes (native order)


class CalleeGone(Exception):
    """The callee process died, or did not answer in time."""

    def __init__(self, why: str, exit_code: int | None = None, role: str = "") -> None:
        super().__init__(why)
        self.why, self.exit_code, self.role = why, exit_code, role


class Refused(Exception):
    """A side's call did not give an output to judge (raised, or an output refused)."""

    def __init__(self, role: str, stage: str, kind: str, text: str) -> None:
        super().__init__(f"{role} {stage}: {kind}: {text}")
        self.role, self.stage, self.kind, self.text = role, stage, kind, text


@dataclass
class CallRecord:
    """One call as the driver saw it."""

    status: str  # ok | raised | bad_output | too_large | internal
    t0_ns: int  # request published (driver's clock)
    t1_ns: int  # completion seen (driver's clock)
    aliases: bool  # the output's memory overlaps an input's (seen by the dispatcher)
    message: str = ""  # the exception's text (raised) or the refused type (bad_output)

    @property
    def span_ns(self) -> int:
        return self.t1_ns - self.t0_ns


@dataclass
class BadOutput:
    """An output the dispatcher refused: not an exact array, container or plain value."""

    type_name: str


class Block:
    """The shared block of one callee: create it, hand ``fd`` to the callee, call."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("krex-dispatch", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.size = size
        self.alive: Any = lambda: None  # returns an exit code once the callee is gone
        self.calls_ns = 0  # the span of every function call so far (empty calls not)
        self.role = ""  # whose block: named in CalleeGone

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _ctl(self) -> tuple[int, ...]:
        return CTL.unpack_from(self.map, 0)

    def call(self, op: int, slot: int = 0, src: int = 0,
             timeout_s: float = 60.0) -> CallRecord:
        """Run one call; :class:`CalleeGone` if the callee died or ran past ``timeout_s``."""
        waited = 0.0
        while True:  # the previous call's after-work first (nothing published yet)
            state, t0, t1 = _dispatch.call(self.map, op, slot, src, int(SLICE_S * 1e9))
            if state != W_NOT_READY:
                break
            waited = self._check(waited + SLICE_S, timeout_s)
        while state == W_IN_FLIGHT:
            waited = self._check(waited + SLICE_S, timeout_s)
            state, t1 = _dispatch.wait(self.map, int(SLICE_S * 1e9))
        if op == OP_CALL:
            self.calls_ns += t1 - t0
        ctl = self._ctl()
        status, aliases, meta_len = ctl[7], ctl[9], ctl[10]
        message = ""
        if status in (1, 2):
            message = self._meta(meta_len).decode("utf-8", "replace")[:2000]
        return CallRecord(STATUS.get(status, "internal"), t0, t1, bool(aliases), message)

    def _check(self, waited: float, timeout_s: float) -> float:
        code = self.alive()
        if code is not None:
            raise CalleeGone(f"exit code {code}", code, self.role)
        if waited >= timeout_s:
            raise CalleeGone(f"no answer within {timeout_s:g} s", None, self.role)
        return waited

    def mutated(self, timeout_s: float = 60.0) -> bool:
        """Whether the last call wrote to its inputs (the callee's after-work, awaited)."""
        waited = 0.0
        while not _dispatch.settle(self.map, int(SLICE_S * 1e9)):
            waited = self._check(waited + SLICE_S, timeout_s)
        return bool(self._ctl()[8])

    def exit(self) -> None:
        """Ask the callee's loop to return (its process then exits)."""
        try:
            _dispatch.call(self.map, OP_EXIT, 0, 0, int(0.5e9))
        except (OSError, ValueError):
            pass

    def _meta(self, length: int) -> bytes:
        length = max(0, min(length, LAYOUT["meta_capacity"]))
        off = LAYOUT["meta_offset"]
        return bytes(self.map[off:off + length])

    def output(self, prefix: str) -> tuple[dict[str, Any], dict[str, Any]] | BadOutput:
        """The last call's output as ``values.flatten``'s (structure, arrays): host copies
        of the bytes the dispatcher wrote (``prefix`` names the arrays)."""
        ctl = self._ctl()
        meta = json.loads(self._meta(ctl[10]))
        if meta.get("t") == "bad":
            return BadOutput(str(meta.get("type")))
        arrays: dict[str, Any] = {}
        try:
            return self._structure(meta, arrays, prefix, int(ctl[12])), arrays
        except (KeyError, ValueError, TypeError) as exc:
            return BadOutput(f"unreadable output ({exc})")

    def _structure(self, s: dict[str, Any], arrays: dict[str, Any], prefix: str,
                   data_len: int) -> dict[str, Any]:
        kind = s["t"]
        if kind == "array":
            return self._array(s, arrays, prefix, data_len)
        if kind == "seq":
            return {"t": "seq", "kind": s["kind"],
                    "items": [self._structure(i, arrays, prefix, data_len) for i in s["items"]]}
        if kind == "map":
            return {"t": "map", "keys": [k for k, _ in s["items"]],
                    "items": [self._structure(v, arrays, prefix, data_len)
                              for _, v in s["items"]]}
        if "float" in s:
            value = s["float"]
            return {"t": "value", "value": float(value), "type": "float"}
        value = s["value"]
        return {"t": "value", "value": value, "type": type(value).__name__ if value is not None
                else "NoneType"}

    def _array(self, s: dict[str, Any], arrays: dict[str, Any], prefix: str,
               data_len: int) -> dict[str, Any]:
        import numpy as np

        dtype = np.dtype(_dtype_of(s["format"]))
        shape, offset, nbytes = [int(n) for n in s["shape"]], int(s["offset"]), int(s["nbytes"])
        count = 1
        for n in shape:
            count *= n
        if dtype.itemsize != int(s["itemsize"]) or nbytes != count * dtype.itemsize \
                or offset < 0 or offset + nbytes > data_len \
                or LAYOUT["data_offset"] + offset + nbytes > self.size:
            raise ValueError(f"array {s['format']} {shape} does not fit its bytes")
        start = LAYOUT["data_offset"] + offset
        key = f"{prefix}#{len(arrays)}"
        arrays[key] = np.frombuffer(self.map, dtype, count, start).reshape(shape).copy()
        return {"t": "array", "key": key, "dtype": dtype.name, "shape": shape, "lib": "numpy",
                "device": "cpu"}


def _dtype_of(fmt: str) -> str:
    """A buffer format of a plain numeric dtype in this machine's byte order, else refused."""
    code = fmt.lstrip("@=" + ("<" if sys.byteorder == "little" else ">"))
    if code not in FORMATS:
        raise ValueError(f"buffer format {fmt!r} is not a plain numeric dtype")
    return FORMATS[code]
