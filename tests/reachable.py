"""Run a command where every directory above PATHS lets other users in: a node's install.

A node daemon's tenant users (krex.daemon.users) must run the interpreter and
import krex.  This machine keeps its Python under /root (0700), as a developer's
machine does; a node installs krex where every user may read it.  Run as root
in a mount namespace of its own (``unshare -m --propagation private``), this
puts, over each such directory, a tmpfs that others may enter holding the same
entries (bind mounts of the originals): the same files, only the blocking
directory's own mode differs, and only for the command and what it starts.

    unshare -m --propagation private python tests/reachable.py PATH... -- CMD...
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys


def blocked(paths: list[str]) -> list[str]:
    """The directories above (and including the parents of) ``paths`` that others may
    not enter, outermost first."""
    out: list[str] = []
    for path in paths:
        parts = os.path.realpath(path).split(os.sep)[1:-1]
        for i in range(len(parts)):
            d = os.sep + os.sep.join(parts[: i + 1])
            if not os.stat(d).st_mode & stat.S_IXOTH and d not in out:
                out.append(d)
    return sorted(out, key=lambda d: d.count(os.sep))


def open_up(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)  # the original, reached through /proc
    entries = os.listdir(fd)
    mode = stat.S_IMODE(os.stat(d).st_mode) | 0o055
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode={mode:o}", "tmpfs", d], check=True)
    for name in entries:
        src, dst = f"/proc/{os.getpid()}/fd/{fd}/{name}", os.path.join(d, name)
        st = os.lstat(src)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
            continue
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(dst)
        else:
            open(dst, "w").close()
        subprocess.run(["mount", "--no-canonicalize", "--bind", src, dst], check=True)


def main(argv: list[str]) -> None:
    cut = argv.index("--")
    for d in blocked(argv[:cut]):
        open_up(d)
    os.execvp(argv[cut + 1], argv[cut + 1:])


if __name__ == "__main__":
    main(sys.argv[1:])
