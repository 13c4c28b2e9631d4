"""One benchmarking program on its way to a node, and the way it reports back.

In: a path to a Python program (its text is shipped, so nodes need no shared
file system), its arguments and device.  Out: a JSON-able dict that travels
through Ray to the node actor.  A program hands data back (measurements,
region reports, its own timestamps) with :func:`emit`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from krex import resultfile
from krex.errors import BadRequest

RESULT_ENV = "KREX_RAY_RESULT"  # where emit() writes, set by the node actor per program


@dataclass
class Program:
    path: str  # as given; on the node only used when source is None
    args: list[str] = field(default_factory=list)
    device: str = "cpu"
    source: str | None = None
    timeout_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the node's environment
    cwd: str | None = None  # on the node; default: the shipped program's directory
    program_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    submitted_wall_s: float = field(default_factory=time.time)

    @classmethod
    def load(cls, path: str, args: list[str] | None = None, *, ship: bool = True,
             **kw: Any) -> Program:
        """A program from ``path``; with ``ship`` its text travels with it."""
        if not os.path.isfile(path):
            raise BadRequest(f"no such program: {path}", hint="give the path of a .py file")
        source = None
        if ship:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        return cls(path=os.path.abspath(path), args=[str(a) for a in args or []],
                   source=source, **kw)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def materialise(self, directory: str) -> str:
        """The path to run on this node: the shipped text, written once per content."""
        if self.source is None:
            return self.path
        digest = hashlib.sha256(self.source.encode()).hexdigest()[:16]
        os.makedirs(directory, mode=0o700, exist_ok=True)
        target = os.path.join(directory, f"{digest}-{self.name}")
        if not os.path.exists(target):
            # A unique temporary name: the node actor runs concurrent calls in threads of
            # one process, so a pid-based name raced (one replace moved the other's file).
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{digest}-", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.source)
            os.replace(tmp, target)
        return target

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Program:
        return cls(**data)


def emit(data: Any) -> bool:
    """From inside a program: hand ``data`` (JSON-able, or with ``to_dict()``) back.

    It becomes ``result["returned"]``.  Returns False (and does nothing) when the
    program is not running under ``krex.ray``.
    """
    target = os.environ.get(RESULT_ENV)
    if not target:
        return False
    if hasattr(data, "to_dict"):
        data = data.to_dict()
    resultfile.write(target, data, indent=None, default=str)
    return True


def collect(target: str) -> Any:
    """Read (and remove) what the program emitted; None when it emitted nothing."""
    try:
        with open(target, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        os.unlink(target)
    except OSError:
        pass
    return data
