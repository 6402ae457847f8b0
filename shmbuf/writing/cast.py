"""Turn what a caller passes for a column into an array that fits it, losslessly.

The rules, one per source kind:
- the exact dtype, or a cast numpy calls "safe": accepted;
- bool targets take any number that is exactly 0 or 1;
- float -> narrower float: accepted unless a finite value would overflow;
- int -> int or int -> float: accepted when every value survives the round trip;
- float or complex -> integer, complex -> real, and everything else: rejected.
A rejected value raises before anything is written.
"""
from __future__ import annotations

import numpy as np


def host_array(value) -> np.ndarray:
    """``value`` as an ndarray in host memory: an ndarray as it is, a torch tensor (on
    any device) detached and copied to the CPU, anything else through ``np.asarray``.

    The one conversion every layer uses for what a caller passes (torch is never
    imported: a tensor is recognised by its type's module).
    """
    if type(value) is np.ndarray:
        return value
    module = type(value).__module__
    if module.startswith("torch"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _lossless(arr: np.ndarray, dtype: np.dtype) -> bool:
    src, dst = arr.dtype, dtype
    if np.can_cast(src, dst, "safe"):
        return True
    if dst.kind == "b":
        if src.kind not in "iuf":
            return False
        return bool(np.all((arr == 0) | (arr == 1)))
    if src.kind == "f" and dst.kind == "f":
        with np.errstate(over="ignore"):
            cast = arr.astype(dst)
        return not np.any(np.isinf(cast) & np.isfinite(arr))
    if src.kind in "iu" and dst.kind in "iuf":
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.array_equal(arr.astype(dst).astype(src), arr))
    if src.kind in "US" and dst.kind == src.kind:
        return bool(np.array_equal(arr.astype(dst), arr))
    return False


def coerce(label: str, value, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Return ``value`` as an array of ``shape`` that casts to ``dtype`` losslessly.

    ``label`` names the argument in the error, e.g. ``"add(obs=...)"``.
    Raises ValueError on a wrong shape and TypeError on a lossy or
    impossible cast.
    """
    try:
        arr = host_array(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{label}: cannot read {type(value).__name__} as an array "
                        f"({exc})") from None
    if arr.shape != shape:
        raise ValueError(f"{label}: expected shape {shape}, got {arr.shape}")
    if arr.dtype != dtype and not _lossless(arr, dtype):
        raise TypeError(f"{label}: {_why_not(arr, dtype)}; nothing was written. Convert it "
                        f"explicitly (e.g. value.astype({_dtype_name(dtype)!r})) if losing "
                        "information is what you mean")
    return arr


def _dtype_name(dtype: np.dtype) -> str:
    return dtype.str if dtype.kind in "US" else dtype.name


def _range(dtype: np.dtype, source: np.dtype | None = None) -> str:
    """What a column of ``dtype`` holds, for messages."""
    if dtype.kind == "b":
        return "False/True or 0/1"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return f"integers {info.min}..{info.max}"
    if dtype.kind == "f":
        if source is not None and source.kind in "iu":
            return f"integers are exact up to +-2**{np.finfo(dtype).nmant + 1}"
        return f"real numbers within +-{float(np.finfo(dtype).max):g}"
    if dtype.kind in "US":
        width = dtype.itemsize // (4 if dtype.kind == "U" else 1)
        return f"{'strings' if dtype.kind == 'U' else 'bytes'} of at most {width} characters"
    return f"{dtype} values"


def _why_not(arr: np.ndarray, dtype: np.dtype) -> str:
    """Name the first value of ``arr`` that ``dtype`` cannot hold exactly."""
    flat = arr.reshape(-1)
    if arr.dtype.kind == "c" and dtype.kind in "biuf":
        where = np.flatnonzero(flat.imag != 0)
        if len(where):
            return (f"{flat[where[0]].item()!r}{_at(where[0], arr)} has an imaginary part, "
                    f"and a {dtype} column holds {_range(dtype)}")
        flat = flat.real
    if flat.dtype.kind in "biuf" and dtype.kind in "biuf":
        with np.errstate(all="ignore"):
            if dtype.kind == "b":
                bad = ~((flat == 0) | (flat == 1))
            elif flat.dtype.kind == "f" and dtype.kind == "f":
                bad = np.isinf(flat.astype(dtype)) & np.isfinite(flat)
            else:
                bad = flat.astype(dtype).astype(flat.dtype) != flat
        where = np.flatnonzero(bad)
        if len(where):
            return (f"{flat[where[0]].item()!r}{_at(where[0], arr)} does not fit in {dtype} "
                    f"({_range(dtype, flat.dtype)})")
    if arr.dtype.kind in "US" and dtype.kind == arr.dtype.kind:
        width = dtype.itemsize // (4 if dtype.kind == "U" else 1)
        long = [v for v in flat.tolist() if len(v) > width]
        if long:
            return f"{long[0]!r} does not fit in {dtype} ({_range(dtype)})"
    return (f"{arr.dtype} values cannot be stored in a {dtype} column ({_range(dtype)}) "
            "without losing information")


def _at(i: int, arr: np.ndarray) -> str:
    if arr.ndim == 0:
        return ""
    return f" (at index {tuple(int(j) for j in np.unravel_index(i, arr.shape))})"


def scalar_fast_path(value, dtype: np.dtype) -> bool:
    """True when ``value`` is a plain Python scalar that ``dtype`` holds exactly."""
    t = type(value)
    kind = dtype.kind
    if t is bool:
        return kind in "biuf"
    if t is float:
        if kind == "b":
            return value == 0.0 or value == 1.0  # done flags passed as floats
        if kind != "f":
            return False
        return (abs(value) <= float(np.finfo(dtype).max) or value != value
                or abs(value) == float("inf"))
    if t is int:
        if kind in "iu":
            info = np.iinfo(dtype)
            return info.min <= value <= info.max
        return kind == "f" and abs(value) <= 2 ** np.finfo(dtype).nmant
    return False


def check_flags(label: str, value, dtype: np.dtype, at) -> None:
    """Refuse a float (or complex) done value that is not exactly 0 or 1.

    A float done column holds flags: 0.5 or -3.0 must not end an episode
    silently, nor NaN.  The writer calls this for float done columns only,
    with the value it is about to store (a step, or one value per step or
    env; a Python scalar the column holds exactly comes as it is) and the
    column's ``dtype``.  ``at(i)`` names the step of flat index ``i`` for
    the message.

    Raises:
        ValueError: naming the value and the step; the caller writes nothing.
    """
    flat = np.asarray(value).astype(dtype, copy=False).reshape(-1)   # lossless: coerced
    bad = np.flatnonzero((flat != 0) & (flat != 1))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{label}: a float done column takes exactly 0 or 1 (1 ends the "
                         f"episode), got {flat[i].item()!r} at {at(i)}; pass a bool or 0/1, or "
                         "create the buffer with a bool done column; nothing was written")
