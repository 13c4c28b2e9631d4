"""A hack on its own module (it acts at import): rewrite the reference's expected outputs.

When it is imported the reference's outputs are already on file in the
evaluation's directory (and the pre-check's copy in memory): it finds both
through the importing frames, turns every expected array to zeros and then
returns zeros — right against the rewritten reference, and very fast.  The
announced digest of the reference's files is what catches it.  When the
evaluating process already holds the reference's outputs (krex.evaluate.references)
there are no files to rewrite: it writes zeros there anyway, and fools the
pre-check alone — the judge compares with the evaluator's copy.
"""

import os
import sys

import numpy as np


def _rewrite():
    frame = sys._getframe(1)
    while frame is not None:
        run = frame.f_locals.get("self")
        job = getattr(run, "job", None)
        if isinstance(job, dict) and "dir" in job:
            for _, arrays in run.expected.values():
                for key in arrays:
                    arrays[key] = np.zeros_like(arrays[key])
            path = f"{job['dir']}/reference.bin"  # the arrays' raw bytes: zeros are zeros
            size = os.path.getsize(path) if os.path.exists(path) else sum(
                a.nbytes for _, arrays in run.expected.values() for a in arrays.values())
            with open(path, "wb") as f:  # (the evaluator holds the outputs: planted anyway)
                f.write(bytes(size))
            return True
        frame = frame.f_back
    return False


REWRITTEN = _rewrite()


def fn(x):
    return np.zeros_like(x)
