"""JSON for the lean CLI path, on the C module ``_json`` alone.

``import json`` costs ≈ 20 ms of every ``krex exec``/``krex status`` on the
2-core machine (``re``, ``enum`` and ``functools`` come with it; measured in
docs/notes/startup.md), more than everything else the lean path
imports together.  The parsing and string escaping are C code in ``_json``
either way; what ``json`` adds in Python is its configuration.  So here:
:func:`loads` is ``_json``'s scanner with ``json.loads``' defaults, and
:func:`dumps` writes what ``json.dumps`` writes for the plain data the daemon
exchanges (dicts, lists, tuples, strings, numbers, booleans, None; anything
else as its ``str``, like ``default=str``), compact or indented.
``tests/test_cli_startup.py`` checks both against ``json`` on the daemon's
real replies and on edge cases.
"""

from __future__ import annotations

import _json

TYPE_CHECKING = False  # not typing: another ~5 ms of every start
if TYPE_CHECKING:
    from typing import Any

_CONSTANTS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class _Context:
    """The attributes ``_json.make_scanner`` reads: ``json.loads``' defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_CONSTANTS.__getitem__)


_scan = _json.make_scanner(_Context())  # type: ignore[arg-type]  # (typeshed: a JSONDecoder; it reads only these attributes)
_WHITESPACE = " \t\n\r"


def loads(data: bytes | str) -> Any:
    """``json.loads`` for one JSON document; ``ValueError`` when it is not one."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    text = text.strip(_WHITESPACE)
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("no JSON value") from None
    if end != len(text):
        raise ValueError(f"extra data after the JSON value at {end}")
    return value


def dumps(value: Any, indent: int | None = None) -> str:
    """``json.dumps(value, indent=indent, default=str)``; compact (``separators=(",", ":")``)
    when ``indent`` is None."""
    out: list[str] = []
    _encode(value, out, indent, 0)
    return "".join(out)


def _float(x: float) -> str:
    if x != x:
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "Infinity" if x > 0 else "-Infinity"
    return float.__repr__(x)


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if k is True or k is False:
        return "true" if k else "false"
    if k is None:
        return "null"
    if isinstance(k, int):
        return int.__repr__(k)
    if isinstance(k, float):
        return _float(k)
    return str(k)  # json.dumps would raise; the lean path never sends such keys


def _encode(v: Any, out: list[str], indent: int | None, level: int) -> None:
    if isinstance(v, str):
        out.append(_json.encode_basestring_ascii(v))
    elif v is None:
        out.append("null")
    elif v is True or v is False:
        out.append("true" if v else "false")
    elif isinstance(v, int):
        out.append(int.__repr__(v))
    elif isinstance(v, float):
        out.append(_float(v))
    elif isinstance(v, (list, tuple)):
        if not v:
            out.append("[]")
            return
        sep, inner, outer = _layout(indent, level)
        out.append("[" + inner)
        for i, item in enumerate(v):
            if i:
                out.append(sep)
            _encode(item, out, indent, level + 1)
        out.append(outer + "]")
    elif isinstance(v, dict):
        if not v:
            out.append("{}")
            return
        sep, inner, outer = _layout(indent, level)
        colon = ":" if indent is None else ": "
        out.append("{" + inner)
        for i, (k, item) in enumerate(v.items()):
            if i:
                out.append(sep)
            out.append(_json.encode_basestring_ascii(_key(k)) + colon)
            _encode(item, out, indent, level + 1)
        out.append(outer + "}")
    else:
        out.append(_json.encode_basestring_ascii(str(v)))


def _layout(indent: int | None, level: int) -> tuple[str, str, str]:
    """Item separator, text after the opening bracket, text before the closing one."""
    if indent is None:
        return ",", "", ""
    inner = "\n" + " " * (indent * (level + 1))
    return "," + inner, inner, "\n" + " " * (indent * level)
