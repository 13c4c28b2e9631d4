"""A/B test two implementations inside one region with krex.compare.

krex.compare interleaves baseline and candidate samples in the same region
and returns the speedup with a confidence interval and a verdict.
"""

import sys

import krex

DATA = list(range(20_000))


def baseline() -> int:
    return sum(x * x for x in DATA)


def candidate() -> int:
    total = 0
    for x in DATA:
        total += x * x
    return total


def main(reps: int = int(sys.argv[1]) if len(sys.argv) > 1 else 3) -> None:
    assert baseline() == candidate()  # correctness, untimed
    for _ in range(reps):
        # Pure-Python kernels over a small list: warm-cache timing is the realistic case
        # (a cold-cache flush would take most of the 0.3 s budget; docs/measure.md).
        c = krex.compare(baseline, candidate, max_time_s=0.3, cache="hot")
        print(f"compare_kernels: speedup {c.speedup:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}]"
              f" -> {c.verdict} (region held {c.region.held_s:.3f} s, budget 0.3 s)")


if __name__ == "__main__":
    main()
