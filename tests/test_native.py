"""The native interposer: build, ABI check, and every resolution path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, reap, spawn

from krex.devices import native
from krex.devices.fakegpu import FakeGpu
from krex.errors import InterposerMissing

CUDA_H = Path("/usr/local/cuda/include/cuda.h")
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


def run_launcher(launcher: Path, env: dict[str, str], *args: str, timeout: float = 30) -> dict:
    proc = spawn([str(launcher), *args], env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        reap(proc)
    assert proc.returncode == 0, err
    return parse_report(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Path:
    return build_launcher(tmp_path_factory.mktemp("native"))


@pytest.fixture
def gpu():
    with FakeGpu() as g:
        yield g


def test_artefacts_built_by_install():
    assert native.interposer_path().is_file()
    assert (native.fakegpu_lib_dir() / "libcuda.so.1").is_file()
    assert (native.fakegpu_lib_dir() / "libamdhip64.so").is_file()
    assert os.access(native.fakegpu_server_path(), os.X_OK)


def test_abi_check_passes_for_the_built_interposer():
    assert native.check_interposer() == native.interposer_path()
    assert native.interposer_abi() == native.ABI_VERSION


def test_abi_check_rejects_missing_and_foreign_libraries(tmp_path):
    with pytest.raises(InterposerMissing, match="not built"):
        native.check_interposer(tmp_path / "nope.so")
    with pytest.raises(InterposerMissing, match="cannot load"):
        native.check_interposer(native.fakegpu_lib_dir() / "libcuda.so.1")


def test_preload_env_names_gate_file_and_slot(tmp_path):
    env = native.preload_env(tmp_path / "gate", slot=3, base={"LD_PRELOAD": "/x.so"})
    assert env["LD_PRELOAD"].split(":") == [str(native.interposer_path()), "/x.so"]
    assert env["KREX_GATE_FILE"] == str(tmp_path / "gate") and env["KREX_GATE_SLOT"] == "3"


PATHS = [
    ("cuda", "direct", "direct"), ("cuda", "dlsym", "dlsym"), ("cuda", "getproc", "getproc"),
    ("cuda", "getproc_self", "getproc"), ("cuda", "ptds", "getproc"), ("hip", "direct", "direct"),
    ("hip", "dlsym", "dlsym"), ("hip", "getproc", "getproc"), ("hip", "ptds", "direct"),
]


@pytest.mark.parametrize("api,mode,path", PATHS)
def test_every_resolution_path_reaches_a_wrapper(launcher, gpu, api, mode, path):
    env = dict(gpu.env(), LD_PRELOAD=str(native.interposer_path()))
    r = run_launcher(launcher, env, api, mode, "2", "60", "spin_us_5", "16")
    assert r["launches"] > 0
    assert r[path] == r["launches"], r  # every launch went through our wrapper...
    others = {"direct", "dlsym", "getproc"} - {path}
    assert all(r[o] == 0 for o in others), r  # ...of exactly the expected path
    assert r["unmatched"] == 0
    assert gpu.stats()["launches"] == r["launches"]


def test_without_preload_nothing_is_counted(launcher, gpu):
    r = run_launcher(launcher, gpu.env(), "cuda", "getproc", "1", "30", "spin_us_5", "8")
    assert r["launches"] > 0 and r["direct"] == r["dlsym"] == r["getproc"] == 0


@pytest.mark.skipif(not CUDA_H.exists(), reason="CUDA toolkit headers not installed")
def test_hook_signatures_match_cuda_h(tmp_path):
    """Every generated wrapper has exactly the ABI cuda.h declares for that variant."""
    src = tmp_path / "check.c"
    src.write_text(
        "#define __CUDA_API_VERSION_INTERNAL 1\n#include <cuda.h>\n"
        "#define HOOK(name, params, args) CUresult (*chk_##name) params = name;\n"
        f'#include "{REPO}/native/interpose/cuda_hooks.def"\n')
    res = subprocess.run(["cc", "-c", "-Werror", "-Wall", f"-I{CUDA_H.parent}", "-o",
                          str(tmp_path / "check.o"), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.skipif(not shutil.which("nvcc") and not Path("/usr/local/cuda/bin/nvcc").exists(),
                    reason="nvcc not installed")
def test_cuda_runtime_on_fake_driver():
    pytest.skip("NVIDIA's libcudart needs the driver's private export tables (cuGetExportTable), "
                "which the fake driver does not provide; the runtime path is covered by the "
                "getproc launcher modes, which replay what libcudart does")
