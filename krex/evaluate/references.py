"""The reference's outputs, kept in the evaluating process: computed once, not per candidate.

An agent's candidates share the reference and the inputs builder, so the
reference's outputs on every case (and the inputs' hashes) are the same in
each of its evaluations.  :class:`References` keeps the files the first
evaluation's program wrote — only when they matched the digest announced
before the candidate was imported — keyed on the reference's and the inputs
builder's specs (code hashes included), the cases (ids, seeds, shapes), the
device and krex's version.  The entries live in this process's memory,
where no candidate code runs: a candidate can neither read nor rewrite
them.  Each use checks the bytes against the digest they were stored under
(hashed again whenever they are not the very objects last found intact);
a worker that builds inputs whose hashes differ from the stored ones (a
builder that is not a function of its seed) makes the evaluation run again
without the cache.  The kept inputs reach each worker from a sealed memfd of
this process (nobody can change its bytes: the worker checks the seals, not
the hashes; the arrays' index travels in the job), else as hard links to one
copy on disk per entry (written once, not per evaluation), which a program
could rewrite through its link: there the worker checks every case against
the hash the job carries, and a use that found one changed makes the next
use write a fresh copy.  In: the program's reference files; out: their trees.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from typing import Any

from krex.evaluate.worker import REFERENCE_FILES, inputs_digest, seals

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
        self._intact: tuple[bytes, ...] | None = None  # the blobs last found intact
        self.meta: dict[str, Any] = json.loads(blobs[2])
        self.inputs = inputs_digest(self.meta.get("input_hashes", {}))
        self.kept_cases = len(json.loads(blobs[3])["cases"]) if blobs[3] else 0
        self._copy: str | None = None  # path prefix of the kept inputs' copy on disk
        self._sealed: int | None = None  # the sealed memfd's descriptor; -1: none possible
        self._copy_lock = threading.Lock()

    def size(self) -> int:
        return sum(len(b) for b in self.blobs)

    def intact(self) -> bool:
        """Its bytes hash to its digest.  Hashed again only when ``blobs`` is not the tuple
        last found intact: ``bytes`` cannot change in place from Python, and no candidate
        code runs in this process (native code that could would as easily skip this)."""
        if self.blobs is self._intact:
            return True
        ok = digest_of(self.blobs) == self.digest
        self._intact = self.blobs if ok else None
        return ok

    def write_inputs(self, path: str) -> str | None:
        """The kept built inputs as files at ``path`` (for the next worker), or None: hard
        links to this entry's copy, written on first use (written out where no link can
        be made)."""
        if not self.blobs[4]:
            return None
        with self._copy_lock:
            if self._copy is None:
                self._copy = _write_pair(os.path.join(_copies_dir(), str(next(_COPY_IDS))),
                                         self.blobs[3], self.blobs[4])
            copy = self._copy
        try:
            for suffix in (".json", ".bin"):
                os.link(copy + suffix, path + suffix)
        except OSError:  # another file system, or the copy went away
            _unlink_pair(path)
            _write_pair(path, self.blobs[3], self.blobs[4])
        return path

    def sealed_inputs(self) -> dict[str, Any] | None:
        """Where any process of this user can read the kept inputs' arrays from a sealed
        memfd (no write, no resize, no new seals: nobody can change them, so the worker
        need not hash them): its ``/proc`` path and the inode and size the worker must
        find there (a descriptor number can be reused once closed), or None where
        memfds cannot be sealed here."""
        if not self.blobs[4]:
            return None
        with self._copy_lock:
            if self._sealed is None:
                self._sealed = _sealed(self.blobs[4])
            if self._sealed < 0:
                return None
            st = os.fstat(self._sealed)
            return {"path": f"/proc/{os.getpid()}/fd/{self._sealed}", "dev": st.st_dev,
                    "ino": st.st_ino, "size": len(self.blobs[4])}

    def forget_copy(self) -> None:
        """The next use writes a fresh copy: a program rewrote this one, or the entry goes
        (then its sealed copy goes too)."""
        with self._copy_lock:
            copy, self._copy = self._copy, None
        if copy is not None:
            _unlink_pair(copy)

    def close(self) -> None:
        """Forget both copies (the entry leaves the cache)."""
        self.forget_copy()
        with self._copy_lock:
            fd, self._sealed = self._sealed, None
        if fd is not None and fd >= 0:
            os.close(fd)

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
            old = self._entries.get(k)
            self._entries[k] = entry
            gone = [old] if old is not None and old is not entry else []
            while sum(e.size() for e in self._entries.values()) > self.max_bytes:
                gone.append(self._entries.popitem(last=False)[1])
        for e in gone:
            e.close()

    def drop(self, k: str) -> None:
        with self._lock:
            entry = self._entries.pop(k, None)
        if entry is not None:
            entry.close()

    def clear(self) -> None:
        with self._lock:
            gone, self._entries = list(self._entries.values()), OrderedDict()
        for entry in gone:
            entry.close()


_COPY_IDS = itertools.count()
_COPIES: list[str] = []  # this process's directory of kept-input copies, made on first use
_COPIES_LOCK = threading.Lock()


def _copies_dir() -> str:
    with _COPIES_LOCK:
        if not _COPIES:
            _COPIES.append(tempfile.mkdtemp(prefix="krex-evaluate-kept-"))
            atexit.register(shutil.rmtree, _COPIES[0], True)
        return _COPIES[0]


def _write_pair(path: str, structures: bytes, arrays: bytes) -> str:
    for suffix, blob in ((".json", structures), (".bin", arrays)):
        with open(path + suffix, "wb") as f:
            f.write(blob)
    return path


def _sealed(data: bytes) -> int:
    """A memfd holding ``data``, sealed against every change; -1 where that fails."""
    import fcntl

    want = seals()
    if not want:
        return -1
    try:
        fd = os.memfd_create("krex-kept-inputs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return -1
    try:
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.write(fd, view[done:])
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, want)
    except OSError:
        os.close(fd)
        return -1
    return fd


def _unlink_pair(path: str) -> None:
    for suffix in (".json", ".bin"):
        try:
            os.unlink(path + suffix)
        except OSError:
            pass


REFERENCES = References()  # this process's: every evaluation it runs shares it
