"""Which unprivileged user a tenant's code runs as: :class:`RunAs`.

A root node daemon never runs a tenant's code as root: each tenant a trusted
peer (the HTTP/MCP service) names gets a uid of its own from the daemon's
``--tenant-uids`` range, with a group of the same number, the daemon socket's
group beside it (so its programs can take regions) and a home directory of
its own.  The daemon says which (``program_user``); whoever starts a
tenant's process — the daemon's warm workers, a service's bench commands —
calls :meth:`RunAs.preexec`'s function in the child before ``exec``, and whoever hands a
tenant's process a directory to write gives it with :meth:`RunAs.give`.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

PR_SET_NO_NEW_PRIVS = 38
UMASK = 0o077  # what a tenant's process creates is its own: /tmp included
DEFAULT_UIDS = "60500-60999"  # krex serve --tenant-uids: below systemd's dynamic users
SANDBOX_UIDS = "61000-61999"  # an evaluation's candidate under a root driver (KREX_SANDBOX_UIDS)


def uid_range(text: str, what: str) -> range:
    """``"60500-60999"`` -> the uids; ``what`` names the setting in the error."""
    first, sep, last = text.partition("-")
    if not sep or not first.isdigit() or not last.isdigit() or int(last) <= int(first) \
            or int(first) < 1000:
        raise ValueError(f"{what} {text!r} is not FIRST-LAST (two numbers from 1000 up, "
                         "LAST above FIRST)")
    return range(int(first), int(last) + 1)


def has_account(uid: int) -> bool:
    """Whether ``/etc/passwd`` (or NSS) names ``uid``: a uid krex never gives out."""
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def running_uids() -> set[int]:
    """Every real and effective uid a process runs as now (one in use is never given)."""
    import psutil

    out: set[int] = set()
    for p in psutil.process_iter(["uids"]):
        uids = p.info.get("uids")
        if uids is not None:
            out.update((uids.real, uids.effective))
    return out


@dataclass(frozen=True)
class RunAs:
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary: the daemon socket's group
    home: str

    def preexec(self) -> Callable[[], None]:
        """What a child calls before ``exec`` (a ``preexec_fn``) to become this user for
        good, letting no set-user-ID program give it back (``PR_SET_NO_NEW_PRIVS``).
        Made in the parent: the C library is looked up here, not in a forked child of a
        threaded process (where the loader's lock may be held by a thread that is gone)."""
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        groups = list(self.groups)

        def become() -> None:
            os.setgroups(groups)
            os.setgid(self.gid)
            os.setuid(self.uid)
            os.umask(UMASK)
            if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")

        return become

    def env(self) -> dict[str, str]:
        """The variables that say who the process is and where its files go."""
        name = f"krex-{self.uid}"
        return {"HOME": self.home, "USER": name, "LOGNAME": name,
                "XDG_CACHE_HOME": os.path.join(self.home, ".cache"),
                "XDG_CONFIG_HOME": os.path.join(self.home, ".config"),
                "XDG_DATA_HOME": os.path.join(self.home, ".local", "share"),
                "XDG_STATE_HOME": os.path.join(self.home, ".local", "state")}

    def give(self, path: str) -> str:
        """Make ``path`` (a directory this process just created in a directory of its
        own, so nobody can have swapped it for a link) this user's, owner-only."""
        os.chown(path, self.uid, self.gid, follow_symlinks=False)
        os.chmod(path, 0o700)
        return path

    def cannot_reach(self, files: list[str], dirs: list[str]) -> str | None:
        """Why this user could not read ``files`` or enter ``dirs`` (each through every
        directory above it), or None: a tenant's worker must run the interpreter, import
        krex and reach the daemon's socket."""
        for path, last in [*((f, os.R_OK) for f in files), *((d, os.X_OK) for d in dirs)]:
            parts = os.path.abspath(path).split(os.sep)[1:]
            for i in range(len(parts)):
                here = os.sep + os.sep.join(parts[: i + 1])
                need = last if i == len(parts) - 1 else os.X_OK
                try:
                    st = os.stat(here)
                except OSError as exc:
                    return f"{here}: {exc.strerror}"
                if not self._allows(st, need):
                    return (f"{here} ({stat.filemode(st.st_mode)}, uid {st.st_uid}, gid "
                            f"{st.st_gid}) does not let uid {self.uid} "
                            f"{'read it' if need == os.R_OK else 'enter it'}")
        return None

    def _allows(self, st: os.stat_result, need: int) -> bool:
        bits = {os.R_OK: (stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH),
                os.X_OK: (stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)}[need]
        if st.st_uid == self.uid:
            return bool(st.st_mode & bits[0])
        if st.st_gid == self.gid or st.st_gid in self.groups:
            return bool(st.st_mode & bits[1])
        return bool(st.st_mode & bits[2])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "groups": list(self.groups)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RunAs | None:
        if not d:
            return None
        return cls(uid=int(d["uid"]), gid=int(d["gid"]),
                   groups=tuple(int(g) for g in d.get("groups", ())), home=str(d["home"]))
