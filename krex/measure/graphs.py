"""CUDA-graph timing for kernels under 0.1 ms (torch only, optional).

Launch overhead and event resolution swamp very short kernels.  Like
``triton.testing.do_bench_cudagraph``, capture ``inner`` calls of ``fn`` in one
CUDA graph and time each replay; a sample is the replay time / ``inner``.
Within a replay the calls run back to back (the cache is flushed only between
replays).  Untested without a GPU: every failure falls back to plain timing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

GRAPH_BELOW_MS = 0.1
GRAPH_REPLAY_MS = 1.0  # aim for replays of about 1 ms


def wanted(mode: str | bool, device: str, call_ms: float) -> bool:
    """Use a graph when asked (True), or under 0.1 ms on cuda with torch ("auto")."""
    if mode is False or mode == "off":
        return False
    on_cuda = device.startswith("cuda") and "torch" in sys.modules
    if mode is True or mode == "on":
        return on_cuda
    return on_cuda and call_ms < GRAPH_BELOW_MS


def capture(fn: Callable[[], Any], call_ms: float) -> tuple[Callable[[], Any], int] | None:
    """(replay, inner) for a graph of ``inner`` calls, or None when capture fails."""
    try:
        import torch

        inner = max(1, min(1000, int(GRAPH_REPLAY_MS / max(call_ms, 1e-6))))
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()  # capture needs warm allocator state on the side stream
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(inner):
                    fn()
        torch.cuda.synchronize()
        return graph.replay, inner
    except Exception:  # noqa: BLE001 - not capturable (host sync, allocations): time plainly
        return None
