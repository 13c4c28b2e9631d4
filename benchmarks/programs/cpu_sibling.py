"""A sibling job for the fidelity benchmark: CPU-heavy or memory-heavy work forever.

argv: cpu|mem
"""

import sys

kind = sys.argv[1] if len(sys.argv) > 1 else "cpu"
print("running", flush=True)
if kind == "mem":
    src = bytearray(64 << 20)
    dst = bytearray(64 << 20)
    while True:
        dst[:] = src
else:
    x = 0
    while True:
        for i in range(100000):
            x = (x * 31 + i) % 1000003
