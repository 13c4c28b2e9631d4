"""The native interposer: build, ABI check, and every resolution path."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import PY, REPO, reap, spawn
from native_support import build_c, build_launcher, parse_report

from krex.devices import native
from krex.devices.fakegpu import FakeGpu
from krex.enforce.gate import GateFile
from krex.errors import InterposerMissing

CUDA_H = Path("/usr/local/cuda/include/cuda.h")


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
    assert r["unmatched"] == r["unwrapped"] == 0
    assert gpu.stats()["launches"] == r["launches"]


def test_without_preload_nothing_is_counted(launcher, gpu):
    r = run_launcher(launcher, gpu.env(), "cuda", "getproc", "1", "30", "spin_us_5", "8")
    assert r["launches"] > 0 and r["direct"] == r["dlsym"] == r["getproc"] == 0


INTERPOSE = Path(REPO) / "native" / "interpose"
HIP_H = Path("/usr/include/hip/hip_runtime_api.h")


def compile_check(tmp_path: Path, source: str, *flags: str, cc: str = "cc") -> None:
    src = tmp_path / ("check.c" if cc == "cc" else "check.cc")
    src.write_text(source)
    res = subprocess.run([cc, "-c", "-Werror", "-Wall", *flags, "-o", str(tmp_path / "check.o"),
                          str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


def procs_rows(name: str) -> list[tuple[str, str, int, int]]:
    rows = re.findall(r"^PROC\((\w+), (\w+), (\d+), (\d)\)", (INTERPOSE / name).read_text(), re.M)
    return [(b, v, int(s), int(pt)) for b, v, s, pt in rows]


@pytest.mark.skipif(not CUDA_H.exists(), reason="CUDA toolkit headers not installed")
def test_hook_signatures_match_cuda_h(tmp_path):
    """Every generated wrapper has exactly the ABI cuda.h declares for that variant, each
    cuGetProcAddress answer (base, version, flags) is that version's PFN typedef, and the
    stream of a launch configuration is where the interposer reads it."""
    pfn_checks = "".join(
        f"PFN_{b}_v{since}{v[-5:] if pt else ''} chk_pfn_{v} = {v};\n"
        for b, v, since, pt in procs_rows("cuda_procs.def"))
    compile_check(tmp_path,
        "#define __CUDA_API_VERSION_INTERNAL 1\n#include <stddef.h>\n#include <cuda.h>\n"
        "#include <cudaTypedefs.h>\n"
        "#define HOOK(name, params, args, stream, pt) CUresult (*chk_##name) params = name;\n"
        "#define TRACK(name, params, args, kind, obj) CUresult (*chk_##name) params = name;\n"
        f'#include "{INTERPOSE}/cuda_hooks.def"\n#include "{INTERPOSE}/cuda_track.def"\n'
        + pfn_checks +
        "_Static_assert(offsetof(CUlaunchConfig, hStream) == 32, \"stream offset\");\n",
        f"-I{CUDA_H.parent}")
    # the table is the driver's own versioning: cuGetProcAddress itself, and launches
    rows = {(b, v, s, pt) for b, v, s, pt in procs_rows("cuda_procs.def")}
    assert ("cuGetProcAddress", "cuGetProcAddress_v2", 12000, 0) in rows
    assert ("cuLaunchKernel", "cuLaunchKernel_ptsz", 7000, 1) in rows


@pytest.mark.skipif(not HIP_H.exists(),
                    reason="ROCm HIP headers not installed (apt-get install libamdhip64-dev)")
def test_hip_hook_signatures_match_rocm_headers(tmp_path):
    """HIP wrappers have the ABI of ROCm's headers (plus native/include/hip_extra.h)."""
    # hip_ext.h's templates need hip-clang: take its plain declarations only
    ext = re.findall(r"^(?:HIP_PUBLIC_API\s+)?hipError_t\s+\w+\s*\([^;{}]*\)[^;{}]*;",
                     (HIP_H.parent / "hip_ext.h").read_text(), re.M)
    compile_check(tmp_path,
        "#include <hip/hip_runtime_api.h>\n" + "\n".join(ext) + "\n"
        f'#include "{REPO}/native/include/hip_extra.h"\n'
        "#define HOOK(name, params, args, stream, pt) hipError_t (*chk_##name) params = name;\n"
        "#define TRACK(name, params, args, kind, obj) hipError_t (*chk_##name) params = name;\n"
        f'#include "{INTERPOSE}/hip_hooks.def"\n#include "{INTERPOSE}/hip_track.def"\n',
        "-D__HIP_PLATFORM_AMD__", "-Wno-deprecated-declarations", "-Wno-unused-variable",
        cc="c++")  # ROCm's headers are C++ (default arguments)


def test_tables_cover_the_stream_ordered_submissions():
    cuda = (INTERPOSE / "cuda_hooks.def").read_text()
    hip = (INTERPOSE / "hip_hooks.def").read_text()
    for name in ("cuGraphUpload", "cuStreamAddCallback", "cuMemAllocAsync", "cuMemFreeAsync",
                 "cuMemPrefetchBatchAsync", "cuMemDiscardBatchAsync", "cuMemcpyBatchAsync",
                 "cuSignalExternalSemaphoresAsync", "cuWaitExternalSemaphoresAsync",
                 "cuMemMapArrayAsync", "cuLaunchGridAsync"):
        assert f"HOOK({name}," in cuda, name
    for name in ("hipMemcpyWithStream", "hipMemcpy2DAsync", "hipMemcpy3DAsync",
                 "hipMemcpyPeerAsync", "hipMemcpyToSymbolAsync", "hipMemset2DAsync",
                 "hipLaunchHostFunc", "hipStreamWaitValue32", "hipStreamWriteValue64",
                 "hipModuleLaunchCooperativeKernel", "hipExtLaunchKernel", "hipDrvLaunchKernelEx",
                 "hipMemPrefetchAsync"):
        assert f"HOOK({name}," in hip, name


def test_counters_and_abi_are_one_contract():
    """The names and ABI the library exports are those of counters.def / gate.h, and the
    Python side's; a library with other names is refused."""
    lib = native._load()
    assert tuple(native.counter_names(lib)) == native.COUNTERS
    text = (INTERPOSE / "counters.def").read_text()
    assert tuple(re.findall(r"^COUNTER\((\w+),", text, re.M)) == native.COUNTERS
    abi = re.search(r"#define KREX_GATE_ABI (\d+)", (INTERPOSE / "gate.h").read_text())
    assert int(abi.group(1)) == native.ABI_VERSION == lib.krex_interposer_abi_version()
    assert "K_CUDA_END" not in (INTERPOSE / "hooks.c").read_text()  # no sentinel in the enum


PLUGIN = """
int cuInit(unsigned); int cuDeviceGet(int *, int); int cuCtxCreate_v2(void **, unsigned, int);
int cuModuleLoadData(void **, const void *); int cuModuleGetFunction(void **, void *, const char *);
int cuCtxSynchronize(void);
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   void *, void **, void **);
int plugin_no_context(void) { return cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0); }
int plugin_launch(void)
{
    int d, rc; void *c, *m, *f;
    if ((rc = cuInit(0)) || (rc = cuDeviceGet(&d, 0)) || (rc = cuCtxCreate_v2(&c, 0, d)) ||
        (rc = cuModuleLoadData(&m, "x")) || (rc = cuModuleGetFunction(&f, m, "spin_us_10")))
        return -rc;
    rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    return rc ? rc : cuCtxSynchronize();
}
"""
HIP_PLUGIN = """
typedef struct { unsigned x, y, z; } dim3;
int hipModuleLoadData(void **, const void *);
int hipModuleGetFunction(void **, void *, const char *);
int hipDeviceSynchronize(void);
int hipLaunchKernel(const void *, dim3, dim3, void **, unsigned long, void *);
int plugin_no_context(void) { dim3 one = {1, 1, 1}; return hipLaunchKernel(0, one, one, 0, 0, 0); }
int plugin_launch(void)
{
    void *m, *f; int rc; dim3 one = {1, 1, 1};
    if ((rc = hipModuleLoadData(&m, "x")) || (rc = hipModuleGetFunction(&f, m, "spin_us_10")))
        return -rc;
    rc = hipLaunchKernel(f, one, one, 0, 0, 0);
    return rc ? rc : hipDeviceSynchronize();
}
"""
HOST = """
import ctypes, json, os, sys
lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_LOCAL)   # like a Python extension or a plugin
out = {"no_context": lib.plugin_no_context(), "launch": lib.plugin_launch()}
if os.environ.get("LD_PRELOAD"):
    from krex.devices import native
    out["counters"] = native.interposer_counters(native._load())
print(json.dumps(out))
"""


@pytest.mark.parametrize("api", ["cuda", "hip"])
def test_rtld_local_caller_gets_the_drivers_answers(tmp_path, gpu, api):
    """A library linked against the driver (libcuda.so.1, libamdhip64.so) and loaded
    RTLD_LOCAL: same codes with and without krex (the driver is found among the loaded
    objects, not the global scope) and its calls go through the gate."""
    libs = native.fakegpu_lib_dir()
    source, lib = (PLUGIN, "libcuda.so.1") if api == "cuda" else (HIP_PLUGIN, "libamdhip64.so")
    plugin = build_c(tmp_path, "plugin", source, "-shared", f"-L{libs}", f"-l:{lib}",
                     f"-Wl,-rpath,{libs}")
    gate = GateFile.create(tmp_path / "gate")
    try:
        runs = {}
        for preload in (False, True):
            env = native.preload_env(gate.path, base=gpu.env()) if preload else gpu.env()
            done = subprocess.run([PY, "-c", HOST, str(plugin)], env=env, capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0, done.stderr[-2000:]
            runs[preload] = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        gate.unlink()
    no_context = 201 if api == "cuda" else 1  # INVALID_CONTEXT / hipErrorInvalidValue: not 500
    assert runs[False]["no_context"] == runs[True]["no_context"] == no_context
    assert runs[False]["launch"] == runs[True]["launch"] == 0
    counters = runs[True]["counters"]
    assert counters["launch_direct"] == 2 and counters["unwrapped"] == 0  # through the gate


SHIM = """
#define _GNU_SOURCE
#include <dlfcn.h>
int krex_t_next(void) { return 1; }
int shim_probe(void)
{
    int (*f)(void) = (int (*)(void))dlsym(RTLD_NEXT, "krex_t_next");
    return f ? f() : -1;
}
"""
NEXT = "int krex_t_next(void) { return 2; }\n"


def test_dlsym_rtld_next_stays_relative_to_its_caller(tmp_path):
    """Another shim's dlsym(RTLD_NEXT) finds the definition after *it*, not after krex."""
    shim = build_c(tmp_path, "shim", SHIM, "-shared", "-ldl")
    nxt = build_c(tmp_path, "next", NEXT, "-shared")
    code = ("import ctypes, sys; l = ctypes.CDLL(None); f = l.dlsym; f.restype = ctypes.c_void_p;"
            "f.argtypes = [ctypes.c_void_p, ctypes.c_char_p]; print(l.shim_probe(),"
            "*((f(None, None),) if sys.argv[1:] else ()))")
    for preload, args in (([shim, nxt], []), ([native.interposer_path(), shim, nxt], ["krex"])):
        env = dict(os.environ, LD_PRELOAD=":".join(map(str, preload)))
        done = subprocess.run([PY, "-c", code, *args], env=env, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, done.stderr[-1000:]  # with krex, a NULL name does not crash
        assert done.stdout.split() == ["2", *(["None"] if args else [])], done.stdout


def test_selftest_runs_against_a_named_driver(gpu, monkeypatch, tmp_path):
    """`krex doctor`'s self-test takes the real driver when one loads (here: fakegpu's
    library given by path, with the PTX kernel a real driver would JIT)."""
    from krex.devices.selftest import interposer_selftest
    from krex.enforce.gate import GateFile

    monkeypatch.setenv("KREX_FAKEGPU_SOCKET", gpu.socket_path)
    with GateFile.create(str(tmp_path / "gate")) as gate:
        result = interposer_selftest(str(gate.path),
                                     driver=str(native.fakegpu_lib_dir() / "libcuda.so.1"))
    assert result["ok"], result
    assert result["dlsym"] >= 1 and result["getprocaddress"] >= 1 and result["unwrapped"] == 0
    assert result["driver"].endswith("libcuda.so.1") and "krex_nop" not in result["detail"]
