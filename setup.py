"""Build hook: compiles the native parts (interposer, fakegpu) at install time.

Everything else about the package lives in pyproject.toml.  The C sources
live in ``native/``; they are built with the system C compiler into plain
shared libraries and executables (no Python linkage) under ``krex/_native/``:

    krex/_native/libkrex_interpose.so      LD_PRELOAD interposer
    krex/_native/fakegpu/libcuda.so.1       fake CUDA driver
    krex/_native/fakegpu/libamdhip64.so     fake HIP runtime
    krex/_native/bin/krex-fakegpu-server    fakegpu device server
    krex/_native/_dispatch.*.so             krex.evaluate's sealed call loop (a CPython
                                            extension: native/dispatch/dispatch.c)

Works for ``pip install .`` and, in place, for ``pip install -e .``.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
CFLAGS = ["-O2", "-g", "-fPIC", "-Wall", "-std=gnu11", "-fvisibility=hidden"]


def _sources(*globs: str) -> list[str]:
    out: list[str] = []
    for pattern in globs:
        out += sorted(str(p.relative_to(HERE)) for p in HERE.glob(pattern))
    return out


class NativeTarget(Extension):
    """A plain C artefact: ``kind`` is "shared" or "exe"; ``output`` its path in the package."""

    def __init__(self, name: str, output: str, sources: list[str], kind: str = "shared",
                 libraries: tuple[str, ...] = ("dl", "pthread"), ldflags: tuple[str, ...] = ()):
        super().__init__(name, sources=sources, libraries=list(libraries))
        self.output = output
        self.kind = kind
        self.ldflags = list(ldflags)


NATIVE = [
    NativeTarget("krex._native.libkrex_interpose", "krex/_native/libkrex_interpose.so",
                 _sources("native/interpose/*.c")),
    NativeTarget("krex._native.fakegpu.libcuda", "krex/_native/fakegpu/libcuda.so.1",
                 _sources("native/fakegpu/fakecuda.c", "native/fakegpu/client.c"),
                 ldflags=("-Wl,-Bsymbolic", "-Wl,-soname,libcuda.so.1")),
    NativeTarget("krex._native.fakegpu.libamdhip64", "krex/_native/fakegpu/libamdhip64.so",
                 _sources("native/fakegpu/fakehip.c", "native/fakegpu/client.c"),
                 ldflags=("-Wl,-Bsymbolic", "-Wl,-soname,libamdhip64.so")),
    NativeTarget("krex._native.bin.krex_fakegpu_server", "krex/_native/bin/krex-fakegpu-server",
                 _sources("native/fakegpu/server.c"), kind="exe", libraries=("pthread",)),
    # a CPython extension (the only one): krex.evaluate's sealed call loop (issue 42)
    Extension("krex._native._dispatch", sources=["native/dispatch/dispatch.c"],
              extra_compile_args=["-O2", "-std=gnu11", "-Wall"]),
]


class BuildNative(build_ext):
    """Compile each target with the system ``cc`` to its exact file name."""

    def get_ext_filename(self, fullname: str) -> str:
        # setuptools asks with the full dotted name (wants the path from the
        # root), distutils' get_ext_fullpath with the last component only.
        for ext in NATIVE:
            if not isinstance(ext, NativeTarget):
                continue
            if ext.name == fullname:
                return ext.output
            if ext.name.rsplit(".", 1)[-1] == fullname:
                return os.path.basename(ext.output)
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, NativeTarget):
            return super().build_extension(ext)
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        # setuptools copies editable outputs next to the sources without mkdir.
        (HERE / ext.output).parent.mkdir(parents=True, exist_ok=True)
        objects = self.compiler.compile(ext.sources, output_dir=self.build_temp,
                                        extra_preargs=CFLAGS, include_dirs=["native"])
        libs = ["-l" + lib for lib in ext.libraries]
        if ext.kind == "exe":
            self.compiler.link_executable(objects, str(dest),
                                          extra_postargs=libs + ext.ldflags)
        else:
            self.compiler.link_shared_object(objects, str(dest), extra_postargs=libs + ext.ldflags)


setup(ext_modules=NATIVE, cmdclass={"build_ext": BuildNative})
