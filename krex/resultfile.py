"""Results files: JSON documents with a format version, written atomically.

Every JSON file krex leaves for someone else to read — measurements, the
eval's results, the benchmarks, the GPU check, the guardian's journal, a
program's emitted value — goes through :func:`write`: a temporary file in the
same directory (a unique name: concurrent writers never share one), then a
rename, so a reader sees the old document or the new one, never half of one.
:func:`read` checks the kind and format a reader expects.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any


def write(path: str | os.PathLike[str], doc: dict[str, Any], *, format: int | None = None,
          kind: str | None = None, indent: int | None = 1,
          default: Callable[[Any], Any] | None = None) -> str:
    """Write ``doc`` to ``path`` atomically; ``format`` / ``kind`` go first when given."""
    path = os.fspath(path)
    head: dict[str, Any] = {}
    if format is not None:
        head["format"] = format
    if kind is not None:
        head["kind"] = kind
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            # dumps, not dump: one C-encoded string instead of Python-iterated chunks
            f.write(json.dumps({**head, **doc}, indent=indent, default=default) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read(path: str | os.PathLike[str], *, kind: str | None = None,
         format: int | None = None) -> dict[str, Any]:
    """The document at ``path``; ``ValueError`` when it is not of ``kind`` / ``format``."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{os.fspath(path)} does not hold a JSON object")
    if kind is not None and doc.get("kind") != kind:
        raise ValueError(f"{os.fspath(path)} is not a {kind} file (kind {doc.get('kind')!r})")
    if format is not None and doc.get("format") != format:
        raise ValueError(f"{os.fspath(path)} is not of format {format} "
                         f"(format {doc.get('format')!r})")
    return doc
