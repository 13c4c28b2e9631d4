"""A compute-bound CPU "kernel" timed inside krex regions.

Start-up and the correctness check run outside the region, concurrently
with other commands; only the timed loop holds the device.
Run it alone (`python examples/compute_kernel.py`) or as a managed job
(`krex run -- python examples/compute_kernel.py`).
"""

import statistics
import sys
import time

import krex


def kernel(n: int = 20_000) -> int:
    acc = 0
    for i in range(n):
        acc += (i * i) % 7
    return acc


def main(reps: int = int(sys.argv[1]) if len(sys.argv) > 1 else 8) -> None:
    assert kernel(100) == sum((i * i) % 7 for i in range(100))  # correctness, untimed
    samples = []
    for _ in range(reps):
        kernel()  # warm-up outside the region
        with krex.region(label="compute") as r:
            t0 = time.perf_counter()
            kernel()
            samples.append(time.perf_counter() - t0)
    print(f"compute_kernel: median {statistics.median(samples) * 1e3:.3f} ms "
          f"over {reps} regions (last waited {r.report.waited_s * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
