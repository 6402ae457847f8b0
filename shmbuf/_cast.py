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


def _to_numpy(value):
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
        arr = _to_numpy(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{label}: cannot read {type(value).__name__} as an array ({exc})") from None
    if arr.shape != shape:
        raise ValueError(f"{label}: expected shape {shape}, got {arr.shape}")
    if arr.dtype != dtype and not _lossless(arr, dtype):
        raise TypeError(
            f"{label}: cannot store dtype {arr.dtype} in a {dtype} column without losing "
            f"information; convert it explicitly (e.g. value.astype({dtype.name!r})) if that "
            "is what you mean")
    return arr


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
        return abs(value) <= float(np.finfo(dtype).max) or value != value or abs(value) == float("inf")
    if t is int:
        if kind in "iu":
            info = np.iinfo(dtype)
            return info.min <= value <= info.max
        return kind == "f" and abs(value) <= 2 ** np.finfo(dtype).nmant
    return False
