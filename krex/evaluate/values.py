"""Argument and result trees: host copies, hashes, files, aliasing, tolerant comparison.

A *tree* is what an inputs builder or a kernel returns: numpy arrays, torch
tensors (CPU or device), Python scalars, ``None``, and tuples, lists or
string-keyed dicts of them.  :func:`flatten` turns a tree into a JSON-able
*structure* plus host numpy arrays (device tensors are copied to the host,
``bfloat16`` widened to ``float32`` with its dtype name kept), which is what
crosses the process boundary: :func:`save` writes ``.json`` + ``.bin`` (raw bytes, no
pickle: the evaluator never unpickles data a candidate could have written).
:func:`compare` judges a candidate's tree against the reference's with
dtype-aware tolerances.  numpy is imported lazily; torch never (tensors are
recognised by their methods).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mmap

# Default tolerances by dtype name: |cand - ref| <= atol + rtol * |ref|, elementwise.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-2, 1e-2),
    "bfloat16": (1e-2, 1e-2),
    "float32": (1e-4, 1e-4),
    "complex64": (1e-4, 1e-4),
    "float64": (1e-7, 1e-7),
    "complex128": (1e-7, 1e-7),
}
EXACT = (0.0, 0.0)  # integers, booleans, everything else
MAX_REPORTED = 3  # mismatching elements quoted as evidence


def tolerance(dtype: str, atol: float | None = None,
              rtol: float | None = None) -> tuple[float, float]:
    """(atol, rtol) for a dtype name: the defaults above unless overridden."""
    default = TOLERANCES.get(dtype, EXACT)
    return (default[0] if atol is None else atol, default[1] if rtol is None else rtol)


def is_tensor(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def is_array(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "numpy" and hasattr(x, "dtype") \
        and hasattr(x, "shape") or is_tensor(x)


def dtype_name(x: Any) -> str:
    if is_tensor(x):
        return str(x.dtype).removeprefix("torch.")
    return str(x.dtype.name)


def to_host(x: Any) -> Any:
    """A numpy copy of an array or tensor (bfloat16 and other non-numpy dtypes widened)."""
    import numpy as np

    if is_tensor(x):
        t = x.detach().to("cpu")
        if dtype_name(x) in ("bfloat16",) or "float8" in dtype_name(x):
            t = t.float()
        return t.numpy().copy()
    return np.array(x, copy=True)


def iter_arrays(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, array-or-tensor) for every array leaf, depth first."""
    if is_array(tree):
        yield path or "/", tree
    elif isinstance(tree, (tuple, list)):
        for i, item in enumerate(tree):
            yield from iter_arrays(item, f"{path}/{i}")
    elif isinstance(tree, dict):
        for k, item in tree.items():
            yield from iter_arrays(item, f"{path}/{k}")


def flatten(tree: Any, arrays: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The JSON-able structure of ``tree``; its arrays go to ``arrays`` (host copies)."""
    if is_array(tree):
        key = f"{prefix}#{len(arrays)}"
        arrays[key] = to_host(tree)
        device = str(getattr(tree, "device", "cpu"))
        return {"t": "array", "key": key, "dtype": dtype_name(tree), "shape": list(tree.shape),
                "lib": "torch" if is_tensor(tree) else "numpy", "device": device}
    if isinstance(tree, (tuple, list)):
        return {"t": "seq", "kind": type(tree).__name__,
                "items": [flatten(item, arrays, prefix) for item in tree]}
    if isinstance(tree, dict):
        keys = [str(k) for k in tree]
        items = [flatten(v, arrays, prefix) for v in tree.values()]
        return {"t": "map", "keys": keys, "items": items}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"t": "value", "value": tree, "type": type(tree).__name__}
    if hasattr(tree, "item") and hasattr(tree, "dtype"):  # a numpy scalar
        return {"t": "value", "value": tree.item(), "type": type(tree).__name__}
    return {"t": "opaque", "type": type(tree).__name__}


def digest(structure: dict[str, Any], arrays: dict[str, Any]) -> str:
    """SHA-256 over a flattened tree: structure, then each array's dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps(_without_keys(structure), sort_keys=True).encode())
    for key in _array_keys(structure):
        a = arrays[key]
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes() if a.flags.c_contiguous else a.copy().tobytes())
    return h.hexdigest()


def _without_keys(s: dict[str, Any]) -> Any:
    if s["t"] == "array":
        return {k: v for k, v in s.items() if k not in ("key", "device")}
    if "items" in s:
        return {**s, "items": [_without_keys(i) for i in s["items"]]}
    return s


def _array_keys(s: dict[str, Any]) -> list[str]:
    if s["t"] == "array":
        return [s["key"]]
    return [k for item in s.get("items", []) for k in _array_keys(item)]


def tree_digest(tree: Any) -> str:
    arrays: dict[str, Any] = {}
    return digest(flatten(tree, arrays, "h"), arrays)


# -- files -----------------------------------------------------------------------------


ARRAYS = ".bin"  # the arrays' bytes, one after the other; their index is in the .json file


def save(path: str, cases: dict[str, Any],
         flattened: dict[str, tuple[dict[str, Any], dict[str, Any]]] | None = None) -> None:
    """Write ``{case: tree}`` as ``path.json`` (structures, and where each array lies in
    ``path.bin``) and ``path.bin`` (the arrays' raw bytes: no pickle, no zip).

    ``flattened`` adds cases already flattened (``(structure, arrays)``).
    """
    arrays: dict[str, Any] = {}
    structures = {case: flatten(tree, arrays, case) for case, tree in cases.items()}
    for case, (structure, more) in (flattened or {}).items():
        structures[case] = structure
        arrays.update(more)
    index, offset = {}, 0
    with open(path + ARRAYS, "wb") as f:
        for key, a in arrays.items():
            if a.dtype.hasobject:
                raise ValueError(f"{key}: an array of Python objects ({a.dtype}) cannot be "
                                 "saved without pickle")
            # C order, whatever the array's layout: written from its own memory when it
            # is C-contiguous already, else from a copy
            data = a.reshape(-1).view("u1") if a.flags.c_contiguous else a.tobytes()
            f.write(data)
            index[key] = [a.dtype.str, list(a.shape), offset, a.nbytes]
            offset += a.nbytes
    tmp = path + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump({"cases": structures, "arrays": index}, f)
    os.replace(tmp, path + ".json")


def load(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(structures by case, arrays by key) written by :func:`save`; never unpickles."""
    with open(path + ".json", "rb") as f, open(path + ARRAYS, "rb") as g:
        return loads(f.read(), g.read())


def loads(text: bytes, data: bytes | mmap.mmap) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`load` from the files' bytes (or a read-only map of them).  The arrays are
    read-only views of ``data``; an index that names Python objects or reaches beyond
    ``data`` is refused."""
    import numpy as np

    try:
        saved = json.loads(text)
        arrays = {}
        for key, (dtype_str, shape, offset, size) in saved["arrays"].items():
            dtype = np.dtype(dtype_str)
            count = math.prod(shape)
            if dtype.hasobject or offset < 0 or offset + size > len(data) \
                    or size != count * dtype.itemsize:
                raise ValueError(f"{key}: not an array of {dtype_str} {shape} at {offset}")
            arrays[key] = np.frombuffer(data, dtype, count, offset).reshape(shape)
        return saved["cases"], arrays
    except (KeyError, TypeError, AttributeError) as exc:  # not what save wrote
        raise ValueError(f"malformed outputs file: {type(exc).__name__}: {exc}") from None


def unflatten(structure: dict[str, Any], arrays: dict[str, Any]) -> Any:
    """A tree from :func:`flatten`'s structure: writable numpy arrays that own their
    memory, tuples, lists, dicts and plain values.  Not the original where flatten lost
    something (tensors, numpy scalars, non-string keys): check with :func:`tree_digest`."""
    import numpy as np

    kind = structure["t"]
    if kind == "array":
        return np.array(arrays[structure["key"]])
    if kind == "seq":
        items = [unflatten(s, arrays) for s in structure["items"]]
        return tuple(items) if structure["kind"] == "tuple" else items
    if kind == "map":
        return {k: unflatten(s, arrays) for k, s in zip(structure["keys"], structure["items"],
                                                         strict=True)}
    if kind == "value":
        return structure["value"]
    raise ValueError(f"cannot rebuild {structure.get('type', kind)}")


def plain(tree: Any) -> bool:
    """Only what :func:`unflatten` gives back as it was: numpy arrays that own their memory,
    exact tuples, lists and string-keyed dicts of them, plain values."""
    if is_array(tree):
        return type(tree).__name__ == "ndarray" and not is_tensor(tree) and tree.base is None
    if type(tree) in (tuple, list):
        return all(plain(x) for x in tree)
    if type(tree) is dict:
        return all(type(k) is str and plain(v) for k, v in tree.items())
    return tree is None or type(tree) in (bool, int, float, str)


# -- copies, in-place refill and aliasing (in the worker) --------------------------------


def copyable(tree: Any) -> bool:
    """True when :func:`copy_tree` gives what a fresh build would: containers of
    arrays that own their memory (a view's copy would lose its base) and plain values."""
    if is_tensor(tree):
        return type(tree).__name__ == "Tensor" and tree._base is None and not tree.requires_grad
    if is_array(tree):
        return type(tree).__name__ == "ndarray" and tree.base is None or _numpy_scalar(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree) in (tuple, list) and all(copyable(x) for x in tree)
    if isinstance(tree, dict):
        return type(tree) is dict and all(copyable(x) for x in tree.values())
    return tree is None or type(tree) in (bool, int, float, str)


def _numpy_scalar(x: Any) -> bool:
    import numpy as np

    return isinstance(x, np.generic)  # immutable: shared, not copied


def copy_tree(tree: Any) -> Any:
    """A deep copy of a :func:`copyable` tree: new arrays (same device, dtype, layout)."""
    if is_tensor(tree):
        return tree.clone()  # same device, dtype and strides (preserve_format)
    if is_array(tree):
        return tree if _numpy_scalar(tree) else tree.copy(order="K")
    if isinstance(tree, (tuple, list)):
        return type(tree)(copy_tree(x) for x in tree)
    if isinstance(tree, dict):
        return {k: copy_tree(v) for k, v in tree.items()}
    return tree


def unchanged(tree: Any, pristine: Any) -> bool | None:
    """Whether ``tree`` (a :func:`copy_tree` of ``pristine`` handed to a call) is still
    byte for byte what it was copied from: same containers, same plain values (the very
    objects: they are shared, not copied), numpy arrays of the same dtype, shape and bytes.
    An exact comparison at memory speed, where hashing both sides (:func:`tree_digest`)
    costs ~0.3 ms per 512 KiB.  None where it cannot tell (tensors, other objects): check
    with :func:`tree_digest` instead."""
    if type(tree) is not type(pristine):
        return False
    if type(tree) in (tuple, list):
        if len(tree) != len(pristine):
            return False
        return _all_unchanged(zip(tree, pristine, strict=True))
    if type(tree) is dict:
        if list(tree) != list(pristine):
            return False
        return _all_unchanged((tree[k], pristine[k]) for k in tree)
    if tree is None or type(tree) in (bool, int, float, str):
        return tree is pristine or tree == pristine
    if type(tree).__name__ == "ndarray" and not is_tensor(tree):
        return (tree.dtype == pristine.dtype and tree.shape == pristine.shape
                and tree.tobytes() == pristine.tobytes())
    if _numpy_scalar(tree):
        return tree is pristine  # immutable: copy_tree shares it
    return None


def comparable(tree: Any) -> bool:
    """Whether :func:`unchanged` can judge ``tree`` (plain containers, numpy arrays and
    scalars, plain values): by type alone, no bytes read."""
    if type(tree) in (tuple, list):
        return all(comparable(x) for x in tree)
    if type(tree) is dict:
        return all(comparable(x) for x in tree.values())
    if tree is None or type(tree) in (bool, int, float, str):
        return True
    return type(tree).__name__ == "ndarray" and not is_tensor(tree) or _numpy_scalar(tree)


def _all_unchanged(pairs: Any) -> bool | None:
    for tree, pristine in pairs:
        same = unchanged(tree, pristine)
        if same is not True:
            return same
    return True


def refill(dst: Any, src: Any) -> int:
    """Copy every array of ``src`` into the same-place array of ``dst``; returns how many."""
    count = 0
    for (_, d), (_, s) in zip(iter_arrays(dst), iter_arrays(src), strict=False):
        if is_tensor(d):
            d.copy_(s)
        else:
            import numpy as np

            np.copyto(d, s)
        count += 1
    return count


def _span(x: Any) -> tuple[int, int] | None:
    """(first byte, end byte) of an array's underlying buffer, or None if unknown."""
    try:
        if is_tensor(x):
            storage = x.untyped_storage()
            return storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        import numpy as np

        bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds
        low, high = bounds(x)
        return int(low), int(high)
    except Exception:  # noqa: BLE001  (an exotic array: no aliasing evidence)
        return None


def aliases(outputs: Any, inputs: Any) -> list[dict[str, str]]:
    """Output leaves whose memory overlaps an input leaf's."""
    spans = [(p, _span(a)) for p, a in iter_arrays(inputs)]
    found = []
    for out_path, out in iter_arrays(outputs):
        o = _span(out)
        if o is None or o[0] == o[1]:
            continue
        for in_path, s in spans:
            if s is not None and s[0] < o[1] and o[0] < s[1]:
                found.append({"output": out_path, "input": in_path})
    return found


# -- comparison (in the evaluator) ------------------------------------------------------


def compare(ref: tuple[dict[str, Any], dict[str, Any]], cand: tuple[dict[str, Any], dict[str, Any]],
            atol: float | None = None, rtol: float | None = None) -> list[dict[str, Any]]:
    """Problems of the candidate's tree against the reference's; [] when it matches."""
    problems: list[dict[str, Any]] = []
    _compare(ref[0], ref[1], cand[0], cand[1], "", atol, rtol, problems)
    return problems


def _compare(r: dict[str, Any], ra: dict[str, Any], c: dict[str, Any], ca: dict[str, Any],
             path: str, atol: float | None, rtol: float | None, out: list[dict[str, Any]]) -> None:
    where = path or "/"
    if r["t"] != c["t"] or (r["t"] == "seq" and len(r["items"]) != len(c["items"])) \
            or (r["t"] == "map" and r["keys"] != c["keys"]):
        out.append({"kind": "structure", "path": where,
                    "detail": f"expected {_describe(r)}, got {_describe(c)}"})
        return
    if r["t"] in ("seq", "map"):
        names = r.get("keys") or [str(i) for i in range(len(r["items"]))]
        for name, ri, ci in zip(names, r["items"], c["items"], strict=True):
            _compare(ri, ra, ci, ca, f"{path}/{name}", atol, rtol, out)
    elif r["t"] == "array":
        _compare_arrays(r, ra[r["key"]], c, ca[c["key"]], where, atol, rtol, out)
    elif r["t"] == "value":
        _compare_values(r, c, where, out)


def _describe(s: dict[str, Any]) -> str:
    if s["t"] == "array":
        return f"array {s['dtype']}{tuple(s['shape'])}"
    if s["t"] == "seq":
        return f"{s['kind']} of {len(s['items'])}"
    if s["t"] == "map":
        return f"dict with keys {s['keys']}"
    return s.get("type", s["t"])


def _compare_values(r: dict[str, Any], c: dict[str, Any], where: str, out: list) -> None:
    rv, cv = r["value"], c["value"]
    if isinstance(rv, float) and isinstance(cv, (int, float)) and not isinstance(cv, bool):
        atol, rtol = TOLERANCES["float64"]
        if (math.isnan(rv) and math.isnan(cv)) or abs(cv - rv) <= atol + rtol * abs(rv):
            return
    elif rv == cv and type(rv) is type(cv):
        return
    out.append({"kind": "values", "path": where, "detail": f"expected {rv!r}, got {cv!r}"})


def _compare_arrays(r: dict[str, Any], ref: Any, c: dict[str, Any], cand: Any, where: str,
                    atol: float | None, rtol: float | None, out: list[dict[str, Any]]) -> None:
    import numpy as np

    if r["shape"] != c["shape"]:
        out.append({"kind": "shape", "path": where,
                    "detail": f"expected shape {tuple(r['shape'])}, got {tuple(c['shape'])}"})
        return
    if r["dtype"] != c["dtype"]:
        out.append({"kind": "dtype", "path": where,
                    "detail": f"expected dtype {r['dtype']}, got {c['dtype']}"})
        return
    if np.array_equal(ref, cand):  # elementwise equal (NaN never is): within any tolerance,
        return  # at one C pass instead of the float64 diff below (most candidates, most cases)
    a_tol, r_tol = tolerance(r["dtype"], atol, rtol)
    if ref.dtype.kind not in "fc":
        bad = ref != cand
        if bad.any():
            out.append(_values_problem(where, ref, cand, bad, 0.0, 0.0))
        return
    ref_finite, cand_finite = np.isfinite(ref), np.isfinite(cand)
    new_nonfinite = ref_finite & ~cand_finite
    if new_nonfinite.any():
        idx = [list(ix) for ix in first_true(new_nonfinite, MAX_REPORTED)]
        out.append({"kind": "non_finite", "path": where, "count": int(new_nonfinite.sum()),
                    "detail": f"{int(new_nonfinite.sum())} NaN/Inf where the reference is finite "
                              f"(first at {idx})"})
        return
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(cand.astype(np.float64) - ref.astype(np.float64))
        allowed = a_tol + r_tol * np.abs(ref.astype(np.float64))
        bad = (diff > allowed) & ref_finite
        bad |= ~ref_finite & ~((ref == cand) | (np.isnan(ref) & np.isnan(cand)))
    if bad.any():
        out.append(_values_problem(where, ref, cand, bad, a_tol, r_tol, diff))


def _values_problem(where: str, ref: Any, cand: Any, bad: Any, atol: float, rtol: float,
                    diff: Any = None) -> dict[str, Any]:
    import numpy as np

    idx = first_true(bad, MAX_REPORTED)
    examples = [{"index": list(i), "expected": _num(ref[i]), "got": _num(cand[i])} for i in idx]
    problem = {"kind": "values", "path": where, "count": int(bad.sum()), "size": int(bad.size),
               "atol": atol, "rtol": rtol, "examples": examples,
               "detail": f"{int(bad.sum())} of {bad.size} elements beyond atol={atol:g}, "
                         f"rtol={rtol:g}"}
    if diff is not None:
        finite = diff[np.isfinite(diff)]
        problem["max_abs_err"] = float(finite.max()) if finite.size else float("inf")
    return problem


def first_true(mask: Any, n: int) -> list[tuple[int, ...]]:
    """The indices of the first ``n`` true elements of ``mask``, in C order, found in
    chunks that grow: ``np.argwhere`` would build the index of every true element first
    (all of them for a wrong output: 2 MB for 131k elements, to quote 3)."""
    import numpy as np

    flat = mask.reshape(-1)
    found: list[int] = []
    start, step = 0, 4096
    while start < flat.size and len(found) < n:
        hits = np.flatnonzero(flat[start:start + step])[:n - len(found)]
        found.extend(int(h) + start for h in hits)
        start, step = start + step, step * 2
    return [tuple(int(i) for i in np.unravel_index(f, mask.shape)) for f in found]


def _num(x: Any) -> Any:
    value = x.item() if hasattr(x, "item") else x
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
