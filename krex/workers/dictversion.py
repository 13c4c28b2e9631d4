"""Which namespaces changed since they were last compared: CPython's dict version tag.

Every mutation of a dict (a key added, removed or rebound, a clear, an update) gives it a
new version from one counter that only grows (PEP 509; ``ma_version_tag`` in CPython
3.6-3.13, read here at its fixed offset with ctypes).  An unchanged tag therefore means an
untouched dict, and the snapshot checks (:class:`krex.workers.fingerprint.Bindings`,
``snapshot._Flat``) skip the namespaces whose tag has not moved since their last exact
comparison, whose answer still holds, instead of comparing thousands of bindings after
every program.  A moved tag says nothing by itself (setting a key back to the same object
moves it too): that namespace is compared exactly, as before, and the answer kept with
the tag read *before* the comparison.

Used only where :func:`available` passes its self-test on this interpreter (the layout
checked against ``len()``, and every kind of mutation seen to move the tag past every
earlier one); elsewhere (another interpreter, a free-threaded build, Python 3.14, where
the field is gone) the callers compare everything.  ``KREX_DICT_TAGS=0`` turns it off.
Native code can write any memory, this field included: out of reach, as in the threat
model of docs/evaluate.md.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import sysconfig
from collections.abc import Callable
from operator import attrgetter
from typing import Any

_WORD = ctypes.sizeof(ctypes.c_ssize_t)
_USED, _TAG = 2 * _WORD, 3 * _WORD  # after ob_refcnt and ob_type: ma_used, ma_version_tag
_VALUE = attrgetter("value")
_state: list[bool] = []  # the self-test's answer, once


def available() -> bool:
    """Whether tags can be trusted here (computed once; ``KREX_DICT_TAGS=0``: never)."""
    if os.environ.get("KREX_DICT_TAGS", "1") == "0":
        return False
    if not _state:
        _state.append(_supported() and _self_test(read))
    return _state[0]


def read(namespace: dict[str, Any]) -> int:
    """The version tag of one dict (only meaningful where :func:`available`)."""
    return ctypes.c_uint64.from_address(id(namespace) + _TAG).value


class Tracker:
    """Namespaces watched by their tags, each with the answer of its last exact comparison.
    Made *before* the caller copies the namespaces (their tags are read now: a change
    made before the copy moves them again); the caller keeps the namespaces alive."""

    def __init__(self, namespaces: list[dict[str, Any]]) -> None:
        self._cells = [ctypes.c_uint64.from_address(id(ns) + _TAG) for ns in namespaces]
        self.tags = list(map(_VALUE, self._cells))  # as read before the last comparison
        self.answers = [False] * len(namespaces)  # unchanged as copied

    def differs(self, compare: Callable[[int], bool]) -> list[bool]:
        """Each namespace's answer: ``compare(i)`` again where its tag moved, else the
        last one (the tag read before ``compare`` runs is kept with its answer)."""
        now = list(map(_VALUE, self._cells))
        if now != self.tags:
            for i in [i for i, (a, b) in enumerate(zip(now, self.tags, strict=True)) if a != b]:
                self.answers[i] = compare(i)
                self.tags[i] = now[i]
        return self.answers


def tracker(namespaces: list[dict[str, Any]]) -> Tracker | None:
    """A :class:`Tracker`, or None where tags are not :func:`available`."""
    return Tracker(namespaces) if available() else None


def class_dict(cls: type) -> dict[str, Any] | None:
    """The dict behind ``vars(cls)`` (a mappingproxy over it; ctypes' types keep a dict
    subclass there, the same header), or None if not found."""
    proxy = vars(cls)
    found = [r for r in gc.get_referents(proxy) if isinstance(r, dict)]
    if len(found) == 1 and len(found[0]) == len(proxy):
        return found[0]
    return None


def _supported() -> bool:
    return (sys.implementation.name == "cpython" and (3, 6) <= sys.version_info[:2] < (3, 14)
            and not sysconfig.get_config_var("Py_GIL_DISABLED"))


def _self_test(read_tag: Callable[[dict[str, Any]], int]) -> bool:
    """The layout (``ma_used`` is ``len()``) and the promise: each kind of mutation moves
    the tag past every tag seen before, and reads do not move it."""

    class Probe:
        attr = 1

    plain: dict[str, Any] = {}
    other, of_class = {"k": 1}, class_dict(Probe)
    if of_class is None:
        return False
    try:
        for d in (plain, other, of_class, {"a": 1, "b": 2}):
            if ctypes.c_ssize_t.from_address(id(d) + _USED).value != len(d):
                return False
        steps = [(plain, lambda: plain.__setitem__("k", 1)),
                 (plain, lambda: plain.__setitem__("k", 2)),
                 (other, lambda: other.pop("k")),
                 (plain, lambda: plain.update(z=3)),
                 (plain, lambda: plain.setdefault("q", 4)),
                 (of_class, lambda: setattr(Probe, "attr", 2)),
                 (of_class, lambda: delattr(Probe, "attr")),
                 (plain, plain.clear)]
        last = max(read_tag(plain), read_tag(other), read_tag(of_class))
        for d, step in steps:
            step()
            now = read_tag(d)
            if now <= last:
                return False
            last = now
        other["x"] = 1
        before = read_tag(other)
        _ = other.get("x"), "x" in other, len(other), list(other.items())
        return read_tag(other) == before
    except (ValueError, OSError):
        return False
