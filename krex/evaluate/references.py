"""The reference's outputs, kept in the evaluating process: computed once, not per candidate.

An agent's candidates share the reference and the inputs builder, so the
reference's outputs on every case (and the inputs' hashes) are the same in
each of its evaluations.  :class:`References` keeps the files the first
evaluation's program wrote — only when they matched the digest announced
before the candidate was imported — keyed on the reference's and the inputs
builder's specs (code hashes included), the cases (ids, seeds, shapes), the
device and krex's version.  The entries live in this process's memory,
where no candidate code runs: a candidate can neither read nor rewrite
them.  Each use checks the bytes against the digest they were stored under;
a worker that builds inputs whose hashes differ from the stored ones (a
builder that is not a function of its seed) makes the evaluation run again
without the cache.  In: the program's reference files; out: their trees.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from krex.evaluate.worker import REFERENCE_FILES, inputs_digest

MAX_BYTES = 256 << 20  # all entries together; the least recently used go first


def key(reference: dict[str, Any], inputs: dict[str, Any], cases: list[dict[str, Any]],
        device: str) -> str:
    """What the reference's outputs depend on: its code, the builder's, the cases, the device."""
    from krex.version import __version__

    data = {"reference": reference, "inputs": inputs, "device": device, "krex": __version__,
            "cases": [[c["id"], c["seed"], c.get("shape")] for c in cases]}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def read(path: str) -> tuple[bytes, ...]:
    """The reference's files a program wrote at ``path``, in ``REFERENCE_FILES`` order."""
    blobs = []
    for suffix in REFERENCE_FILES:
        with open(path + suffix, "rb") as f:
            blobs.append(f.read())
    return tuple(blobs)


def digest_of(blobs: tuple[bytes, ...]) -> str:
    """SHA-256 over the files' bytes in order: ``worker.reference_digest`` of what was read."""
    h = hashlib.sha256()
    for blob in blobs:
        h.update(blob)
    return h.hexdigest()


class Entry:
    """One reference's files, their digest, and the digest of the inputs they were made from."""

    def __init__(self, blobs: tuple[bytes, ...], digest: str) -> None:
        self.blobs, self.digest = blobs, digest  # in worker.REFERENCE_FILES order
        self.meta: dict[str, Any] = json.loads(blobs[2])
        self.inputs = inputs_digest(self.meta.get("input_hashes", {}))

    def size(self) -> int:
        return sum(len(b) for b in self.blobs)

    def intact(self) -> bool:
        return digest_of(self.blobs) == self.digest

    def write_inputs(self, path: str) -> str | None:
        """The kept built inputs as files at ``path`` (for the next worker), or None."""
        if not self.blobs[4]:
            return None
        for suffix, blob in ((".json", self.blobs[3]), (".bin", self.blobs[4])):
            with open(path + suffix, "wb") as f:
                f.write(blob)
        return path

    def tree(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(structures by case, arrays by key), as ``values.load`` reads them: read-only
        views of the kept bytes; never unpickles."""
        from krex.evaluate import values

        return values.loads(self.blobs[0], self.blobs[1])


class References:
    """The evaluating process's reference outputs by :func:`key` (thread-safe, bounded)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, k: str) -> Entry | None:
        """The entry, if there and its bytes still hash to its digest (else it is dropped)."""
        with self._lock:
            entry = self._entries.get(k)
            if entry is not None and not entry.intact():
                del self._entries[k]
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(k)
            self.hits += 1
            return entry

    def put(self, k: str, entry: Entry) -> None:
        """Keep ``entry`` (read and checked against its announced digest by the caller)."""
        if not entry.intact() or entry.size() > self.max_bytes:
            return
        with self._lock:
            self._entries[k] = entry
            while sum(e.size() for e in self._entries.values()) > self.max_bytes:
                self._entries.popitem(last=False)

    def drop(self, k: str) -> None:
        with self._lock:
            self._entries.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


REFERENCES = References()  # this process's: every evaluation it runs shares it
