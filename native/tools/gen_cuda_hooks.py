"""Generate the interposer's CUDA tables from the toolkit's cuda.h and cudaTypedefs.h.

Three files in native/interpose/, all from the headers, so the wrappers can
never drift from the driver ABI:

- ``cuda_hooks.def``: ``HOOK(name, (params), (args), STREAM, PT)`` for every ABI
  variant (``_v2``, ``_ptds``, ``_ptsz``) of the stream-ordered submissions (kernel
  launches, graph launches and uploads, host callbacks, copies, memsets, stream
  memory operations, stream-ordered allocation, batch memory operations,
  external-semaphore signal/wait, sparse mapping).  ``STREAM`` is the expression
  naming the stream the call submits to (``NULL``: the default stream), ``PT`` is
  1 for the per-thread-default-stream variants.
- ``cuda_track.def``: ``TRACK(name, (params), (args), KIND, OBJ)`` for the calls the
  drain must know about: stream and context destruction, stream capture begin
  and end (``KIND`` is what happens, ``OBJ`` the stream or context it happens to).
- ``cuda_procs.def``: ``PROC(base, variant, since, pt)``: which exported variant
  ``cuGetProcAddress(base, version, flags)`` hands out, from the ``PFN_base_vVER``
  typedefs of cudaTypedefs.h (the driver's own versioning).  The interposer
  chooses its wrapper from this table, never from the returned address.

Signatures come from cuda.h preprocessed with ``__CUDA_API_VERSION_INTERNAL``
(which declares every variant under its exported name).  Run by hand when a new
toolkit adds entry points (tests/test_native.py compiles the result against the
headers):

    python native/tools/gen_cuda_hooks.py /usr/local/cuda/include
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SUBMIT = [
    r"cuLaunch", r"cuLaunchGrid(Async)?", r"cuLaunchKernel(Ex)?",
    r"cuLaunchCooperativeKernel(MultiDevice)?", r"cuGraphLaunch", r"cuGraphUpload",
    r"cuLaunchHostFunc", r"cuStreamAddCallback", r"cuMemcpy\w*", r"cuMemset\w*",
    r"cuStreamWriteValue(32|64)", r"cuStreamWaitValue(32|64)", r"cuStreamBatchMemOp",
    r"cuMemPrefetchAsync", r"cuMem\w*BatchAsync", r"cuMemAllocAsync", r"cuMemFreeAsync",
    r"cuMemAllocFromPoolAsync", r"cuSignalExternalSemaphoresAsync",
    r"cuWaitExternalSemaphoresAsync", r"cuMemMapArrayAsync",
]
TRACK = {
    "cuStreamDestroy": "STREAM_DESTROY, hStream",
    "cuCtxDestroy": "CTX_DESTROY, ctx",
    "cuStreamBeginCapture": "CAPTURE_BEGIN, hStream",
    "cuStreamBeginCaptureToGraph": "CAPTURE_BEGIN, hStream",
    "cuStreamEndCapture": "CAPTURE_END, hStream",
}
RESOLVERS = ["cuGetProcAddress"]
SUFFIX = r"(_v[0-9])?(_ptds|_ptsz)?"
PFN = re.compile(r"\bPFN_(cu\w+?)_v(\d+)(_ptds|_ptsz)?\)")
STREAM_OF = {  # calls whose stream is not a parameter named hStream
    "cuLaunchKernelEx": "krex_config_stream(config)",
    "cuLaunchCooperativeKernelMultiDevice": "KREX_CTX_WIDE",
}


def preprocess(cuda_h: Path) -> str:
    cmd = ["cc", "-E", "-P", "-D__CUDA_API_VERSION_INTERNAL", "-x", "c", str(cuda_h)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def base_of(name: str) -> str:
    return re.sub(r"(_v[0-9])?(_ptds|_ptsz)?$", "", name)


def is_pt(name: str) -> int:
    return int(name.endswith(("_ptds", "_ptsz")))


def abi_rank(name: str) -> int:
    m = re.search(r"_v([0-9])(_pt..)?$", name)
    return int(m.group(1)) if m else 1


def arg_name(param: str) -> str:
    return re.findall(r"[A-Za-z_]\w*", param.split("[")[0])[-1]


def declarations(text: str, rtype: str = "CUresult", prefix: str = "cu"
                 ) -> dict[str, tuple[str, str]]:
    """{name: (params, args)} of every function returning ``rtype`` named ``prefix...``."""
    decl = re.compile(rtype + r"\s+(" + prefix + r"\w+)\s*\(([^;{}]*?)\)\s*;", re.S)
    out: dict[str, tuple[str, str]] = {}
    for name, params in decl.findall(text):
        params = re.sub(r"\s*=\s*[^,]+", "", " ".join(params.split()))  # C++ default arguments
        args = "" if params in ("void", "") else ", ".join(arg_name(p) for p in params.split(","))
        out[name] = (params, args)
    return out


def wanted(name: str, patterns: list[str]) -> bool:
    return any(re.fullmatch(p + SUFFIX, name) for p in patterns)


def stream_expr(name: str, args: str) -> str:
    base = base_of(name)
    if base in STREAM_OF:
        return STREAM_OF[base]
    names = args.split(", ")
    return next((n for n in ("hStream", "stream") if n in names), "NULL")


def proc_table(typedefs: str, variants: dict[str, list[str]]) -> list[tuple[str, str, int, int]]:
    """(base, variant, since, pt): the k-th PFN version of a base (per pt-ness) is
    its k-th exported variant in ABI order (cuX < cuX_v2 < cuX_v3)."""
    versions: dict[tuple[str, int], set[int]] = {}
    for base, ver, pt in PFN.findall(typedefs):
        if base in variants:
            versions.setdefault((base, int(bool(pt))), set()).add(int(ver))
    rows = []
    for base, names in sorted(variants.items()):
        for pt in (0, 1):
            exported = sorted((n for n in names if is_pt(n) == pt), key=abi_rank)
            vers = sorted(versions.get((base, pt), ()))
            if len(exported) != len(vers):
                raise SystemExit(f"{base} pt={pt}: variants {exported} vs PFN versions {vers}")
            rows += [(base, n, v, pt) for n, v in zip(exported, vers, strict=True)]
    return rows


def write(dest: Path, head: str, lines: list[str]) -> None:
    intro = [f"/* Generated by native/tools/{Path(sys.argv[0]).name}: do not edit.", head]
    dest.write_text("\n".join(intro + lines) + "\n")


def main() -> None:
    inc = Path(sys.argv[1] if len(sys.argv) > 1 else "/usr/local/cuda/include")
    decls = declarations(preprocess(inc / "cuda.h"))
    version = re.search(r"#define CUDA_VERSION (\d+)", (inc / "cuda.h").read_text()).group(1)
    submit = {n: d for n, d in decls.items() if wanted(n, SUBMIT)}
    track = {n: d for n, d in decls.items() if base_of(n) in TRACK and wanted(n, list(TRACK))}
    resolvers = {n: d for n, d in decls.items() if base_of(n) in RESOLVERS}
    variants: dict[str, list[str]] = {}
    for n in [*submit, *track, *resolvers]:
        variants.setdefault(base_of(n), []).append(n)
    procs = proc_table((inc / "cudaTypedefs.h").read_text(), variants)
    here = Path(__file__).resolve().parents[1] / "interpose"
    write(here / "cuda_hooks.def",
          f" * CUDA {version}.  HOOK(name, (params), (args), STREAM, PT): every gated submission. */",
          [f"HOOK({n}, ({p}), ({a}), {stream_expr(n, a)}, {is_pt(n)})"
           for n, (p, a) in sorted(submit.items())])
    write(here / "cuda_track.def",
          f" * CUDA {version}.  TRACK(name, (params), (args), KIND, OBJ): what the drain must know. */",
          [f"TRACK({n}, ({p}), ({a}), {TRACK[base_of(n)]})" for n, (p, a) in sorted(track.items())])
    write(here / "cuda_procs.def",
          f" * CUDA {version}.  PROC(base, variant, since, pt): cuGetProcAddress's answers.\n"
          f" * KREX_CUDA_TABLE_VERSION: the newest version this table knows. */\n"
          f"#define KREX_CUDA_TABLE_VERSION {version}",
          [f"PROC({b}, {n}, {v}, {pt})" for b, n, v, pt in procs])
    print(f"{len(submit)} submissions, {len(track)} tracked, {len(procs)} versioned variants "
          f"(CUDA {version}) -> {here}")


if __name__ == "__main__":
    main()
