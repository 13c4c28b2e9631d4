"""Native test programs, built against the fake driver (no tests here).

The launcher (native/tests/launcher.c) submits work through every resolution path and
reports its counters as ``name=value`` words; the drainer (native/tests/drainer.c)
plays the drain's scenarios; :func:`build_c` compiles any small source.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from helpers import REPO

from krex.devices import native

LAUNCHER_SRC = Path(REPO) / "native" / "tests" / "launcher.c"


def build_launcher(dest_dir: Path) -> Path:
    """Compile native/tests/launcher.c against the fake libcuda / libamdhip64."""
    libs = native.fakegpu_lib_dir()
    out = dest_dir / "launcher"
    subprocess.run(["cc", "-O2", "-o", str(out), str(LAUNCHER_SRC), f"-L{libs}",
                    "-l:libcuda.so.1", "-l:libamdhip64.so", "-ldl", "-lpthread",
                    f"-Wl,-rpath,{libs}"], check=True, capture_output=True, text=True)
    return out


def parse_report(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def build_c(dest: Path, name: str, source: str, *flags: str) -> Path:
    src = dest / f"{name}.c"
    src.write_text(source)
    out = dest / (f"lib{name}.so" if "-shared" in flags else name)
    subprocess.run(["cc", "-O1", "-fPIC", "-o", str(out), str(src), *flags], check=True,
                   capture_output=True, text=True)
    return out


def build_drainer() -> Path:
    """Compile native/tests/drainer.c against the fake libcuda, in a fresh directory
    (the caller removes it)."""
    libs = native.fakegpu_lib_dir()
    src = (Path(REPO) / "native" / "tests" / "drainer.c").read_text()
    dest = Path(tempfile.mkdtemp(prefix="krex-drainer-"))
    return build_c(dest, "drainer", src, f"-L{libs}", "-l:libcuda.so.1", f"-Wl,-rpath,{libs}")
