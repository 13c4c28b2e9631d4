"""Generate the interposer's HIP tables from ROCm's headers (see gen_cuda_hooks.py).

Reads ``hip/hip_runtime_api.h`` and ``hip/hip_ext.h`` of the installed ROCm
headers (Debian's ``libamdhip64-dev``: ``apt-get install libamdhip64-dev``),
then ``native/include/hip_extra.h`` for entry points newer than those headers,
and writes ``hip_hooks.def``, ``hip_track.def`` and ``hip_procs.def`` in the
same formats as the CUDA tables (HIP has no ABI-versioned variants of these
calls: ``hipGetProcAddress`` picks the ``_spt`` variant on the per-thread flag).

    python native/tools/gen_hip_hooks.py /usr/include
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from gen_cuda_hooks import declarations, write

SUBMIT = [
    r"hipLaunchKernel", r"hipModuleLaunchKernel", r"hipExtModuleLaunchKernel",
    r"hipHccModuleLaunchKernel", r"hipExtLaunchKernel", r"hipLaunchCooperativeKernel",
    r"hipModuleLaunchCooperativeKernel", r"hipLaunchCooperativeKernelMultiDevice",
    r"hipExtLaunchMultiKernelMultiDevice", r"hipDrvLaunchKernelEx", r"hipGraphLaunch",
    r"hipGraphUpload", r"hipLaunchHostFunc", r"hipStreamAddCallback", r"hipMemcpy\w*",
    r"hipDrvMemcpy\w*", r"hipMemset\w*", r"hipStreamWaitValue(32|64)",
    r"hipStreamWriteValue(32|64)", r"hipMemPrefetchAsync", r"hipMallocAsync", r"hipFreeAsync",
    r"hipMallocFromPoolAsync", r"hipSignalExternalSemaphoresAsync",
    r"hipWaitExternalSemaphoresAsync",
]
TRACK = {"hipStreamDestroy": "STREAM_DESTROY, stream",
         "hipStreamBeginCapture": "CAPTURE_BEGIN, stream",
         "hipStreamEndCapture": "CAPTURE_END, stream"}
STREAM_OF = {"hipDrvLaunchKernelEx": "krex_config_stream(config)",
             "hipLaunchCooperativeKernelMultiDevice": "KREX_CTX_WIDE",
             "hipExtLaunchMultiKernelMultiDevice": "KREX_CTX_WIDE"}
HERE = Path(__file__).resolve().parents[1]


def source(inc: Path) -> str:
    text = (f'#include "{inc}/hip/hip_runtime_api.h"\n#include "{inc}/hip/hip_ext.h"\n'
            f'#include "{HERE}/include/hip_extra.h"\n')
    cmd = ["c++", "-E", "-P", "-D__HIP_PLATFORM_AMD__", "-x", "c++", "-"]  # C++ headers
    return subprocess.run(cmd, input=text, check=True, capture_output=True, text=True).stdout


def base_of(name: str) -> str:
    return re.sub(r"_spt$", "", name)


def stream_expr(name: str, args: str) -> str:
    if base_of(name) in STREAM_OF:
        return STREAM_OF[base_of(name)]
    names = args.split(", ")
    return next((n for n in ("stream", "hStream") if n in names), "NULL")


def main() -> None:
    inc = Path(sys.argv[1] if len(sys.argv) > 1 else "/usr/include")
    decls = declarations(source(inc), "hipError_t", "hip")
    version = re.search(r"HIP_VERSION_MAJOR (\d+)\s.*?HIP_VERSION_MINOR (\d+)\s.*?PATCH (\d+)",
                        (inc / "hip/hip_version.h").read_text(), re.S).groups()
    ok = lambda n, pats: any(re.fullmatch(p + r"(_spt)?", n) for p in pats)  # noqa: E731
    submit = {n: d for n, d in decls.items() if ok(n, SUBMIT)}
    track = {n: d for n, d in decls.items() if ok(n, list(TRACK))}
    dest = HERE / "interpose"
    tag = f" * ROCm {'.'.join(version)} headers + native/include/hip_extra.h."
    write(dest / "hip_hooks.def", tag + "  HOOK(name, (params), (args), STREAM, PT). */",
          [f"HOOK({n}, ({p}), ({a}), {stream_expr(n, a)}, {int(n.endswith('_spt'))})"
           for n, (p, a) in sorted(submit.items())])
    write(dest / "hip_track.def", tag + "  TRACK(name, (params), (args), KIND, OBJ). */",
          [f"TRACK({n}, ({p}), ({a}), {TRACK[base_of(n)]})" for n, (p, a) in sorted(track.items())])
    rows = [f"PROC({base_of(n)}, {n}, 0, {int(n.endswith('_spt'))})"
            for n in sorted([*submit, *track, "hipGetProcAddress"])]
    write(dest / "hip_procs.def", tag + "  PROC(base, variant, since, pt). */", rows)
    print(f"{len(submit)} submissions, {len(track)} tracked (ROCm {'.'.join(version)}) -> {dest}")


if __name__ == "__main__":
    main()
