"""A memory-bound CPU "kernel" (a 16 MiB copy) timed inside krex regions."""

import statistics
import sys
import time

import krex

SRC = bytearray(16 << 20)


def kernel() -> bytes:
    return bytes(SRC)


def main(reps: int = int(sys.argv[1]) if len(sys.argv) > 1 else 8) -> None:
    assert len(kernel()) == len(SRC)  # correctness, untimed
    samples = []
    for _ in range(reps):
        with krex.region(label="memcopy"):
            t0 = time.perf_counter()
            kernel()
            samples.append(time.perf_counter() - t0)
    print(f"memory_kernel: median {statistics.median(samples) * 1e3:.3f} ms over {reps} regions")


if __name__ == "__main__":
    main()
