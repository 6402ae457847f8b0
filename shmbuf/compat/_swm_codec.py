"""stable-worldmodel episodes checked and encoded for a shared step store.

swm hands episodes over as ``{column: per-step list or (T, ...) array}``
plus optional episode-scoped values under ``_episode_data``.  This module
turns one into the columns a ``Writer.extend`` call takes, and back:

- numeric and bool columns keep their dtype and per-step shape;
- text columns (``str``/``bytes`` per step) live in a fixed-width numpy
  string column, as wide as twice the longest value of the first episode
  (at least 64), so that a later, longer value is refused before anything
  is written instead of being cut;
- episode-scoped values (strings, bytes, numbers, arrays) are encoded as a
  JSON document spread over the episode's rows of one ``uint8`` column, so
  they are written, published and recycled with the episode; data larger
  than the episode's rows hold takes extra rows before its steps.

Nothing here touches shared memory.
"""
from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

EPISODE_DATA_KEY = "_episode_data"
_MIN_TEXT = 64           # characters a text column holds at least
_MIN_DATA_BYTES = 16     # bytes of episode data per step, at least
_PREFIX = 4              # a little-endian uint32 length before the JSON document


def positive(name: str, value) -> int:
    """``value`` as an int > 0 (a size); TypeError or ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def split_episode(ep: dict) -> tuple[dict, dict]:
    """``(per-step columns, episode data)`` of an swm episode dict (not mutated)."""
    if EPISODE_DATA_KEY not in ep:
        return ep, {}
    rest = {k: v for k, v in ep.items() if k != EPISODE_DATA_KEY}
    data = ep[EPISODE_DATA_KEY] or {}
    if not isinstance(data, dict):
        raise TypeError(f"{EPISODE_DATA_KEY} must be a dict of episode-scoped values, got "
                        f"{type(data).__name__}")
    return rest, dict(data)


def coerce(ep: dict, who: str) -> tuple[dict[str, np.ndarray], int]:
    """The per-step columns as arrays with one shared leading length (swm's checks).

    Raises:
        ValueError: a scalar column, or columns of different lengths.
        TypeError: a column numpy can only hold as Python objects.
    """
    out: dict[str, np.ndarray] = {}
    n: int | None = None
    for col, vals in ep.items():
        if not isinstance(col, str):
            raise TypeError(f"{who}: column names must be str, got {col!r}")
        arr = np.asarray(vals)
        if arr.ndim == 0:
            raise ValueError(f"{who}: column '{col}' is scalar; expected a per-step array")
        if n is None:
            n = arr.shape[0]
        elif arr.shape[0] != n:
            raise ValueError(f"{who}: column '{col}' has length {arr.shape[0]}, expected {n}")
        if arr.dtype.hasobject:
            raise TypeError(f"{who}: column '{col}' holds Python objects (dtype object); "
                            "expected numbers, bools or text per step")
        out[col] = arr
    return out, n or 0


def is_text(dtype: np.dtype) -> bool:
    return dtype.kind in "US"


def column_dtype(arr: np.ndarray) -> np.dtype:
    """The stored dtype of a column first seen as ``arr``: text is widened (module doc)."""
    if not is_text(arr.dtype):
        return arr.dtype
    width = arr.dtype.itemsize // (4 if arr.dtype.kind == "U" else 1)
    return np.dtype(f"{arr.dtype.kind}{max(_MIN_TEXT, 2 * width)}")


def check_value(col: str, arr: np.ndarray, shape: tuple, dtype: np.dtype, who: str) -> None:
    """``arr`` (T, ...) fits a stored column of per-step ``shape`` and ``dtype``.

    Raises:
        ValueError: another per-step shape, text longer than the column, or
            numbers that the column's dtype would change (a lossy cast).
    """
    if arr.shape[1:] != tuple(shape):
        raise ValueError(f"{who}: column '{col}' per-step shape {arr.shape[1:]} mismatches "
                         f"expected {tuple(shape)}")
    if is_text(dtype) != is_text(arr.dtype) or (is_text(dtype) and arr.dtype.kind != dtype.kind):
        raise ValueError(f"{who}: column '{col}' holds {arr.dtype} values but was stored as "
                         f"{dtype} by the first episode")
    if is_text(dtype):
        if arr.dtype.itemsize > dtype.itemsize and arr.size:
            longest = int(np.char.str_len(arr).max())
            cap = dtype.itemsize // (4 if dtype.kind == "U" else 1)
            if longest > cap:
                raise ValueError(f"{who}: column '{col}' has a value of {longest} characters; "
                                 f"it holds at most {cap} (twice the longest of the first "
                                 "episode, at least 64)")
        return
    if not np.can_cast(arr.dtype, dtype, "safe"):
        raise ValueError(f"{who}: column '{col}' has dtype {arr.dtype}, which the stored "
                         f"{dtype} (fixed by the first episode) cannot hold without loss")


# -- episode-scoped data ------------------------------------------------------------------
def _encode_value(key: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, np.generic):
        return {"scalar": value.dtype.str, "data": base64.b64encode(value.tobytes()).decode()}
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return {"array": value.dtype.str, "shape": list(value.shape),
                "data": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode()}
    raise TypeError(f"{EPISODE_DATA_KEY}[{key!r}] is a {type(value).__name__}; episode data "
                    "holds str, bytes, bool, int, float, None, numpy scalars and arrays")


def _decode_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "float" in value:
        return float(value["float"])
    if "bytes" in value:
        return base64.b64decode(value["bytes"])
    raw = base64.b64decode(value["data"])
    if "scalar" in value:
        return np.frombuffer(raw, np.dtype(value["scalar"]))[0]
    return np.frombuffer(raw, np.dtype(value["array"])).reshape(value["shape"]).copy()


def encode_data(data: dict) -> bytes:
    """Episode data as a length-prefixed JSON document (``{}`` when there is none)."""
    doc = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise TypeError(f"{EPISODE_DATA_KEY} keys must be str, got {key!r}")
        doc[key] = _encode_value(key, value)
    body = json.dumps(doc, separators=(",", ":")).encode()
    return len(body).to_bytes(_PREFIX, "little") + body


def data_width(blob: bytes, steps: int) -> int:
    """Bytes per step of the episode-data column, sized from the first episode."""
    return max(_MIN_DATA_BYTES, 8 * math.ceil(2 * len(blob) / steps / 8))


def spread(blob: bytes, steps: int, width: int) -> tuple[int, np.ndarray]:
    """``(extra, rows)``: ``blob`` laid over ``steps + extra`` rows of ``width`` bytes.

    ``extra`` is 0 when the episode's own rows hold it (``rows`` is then
    ``(steps, width)`` uint8, ``blob`` from its first byte).  Otherwise the
    episode is written with ``extra`` rows before its steps that carry only
    data (the table flags them), and the stream starts with ``extra`` as a
    little-endian uint32, then ``blob``; so any size fits, whatever the
    episode's length.
    """
    if len(blob) <= steps * width:
        extra, stream = 0, blob
    else:
        extra = math.ceil((_PREFIX + len(blob)) / width) - steps
        stream = extra.to_bytes(_PREFIX, "little") + blob
    out = np.zeros((steps + extra) * width, np.uint8)
    out[:len(stream)] = np.frombuffer(stream, np.uint8)
    return extra, out.reshape(steps + extra, width)


def extra_rows(first: np.ndarray) -> int:
    """``spread``'s ``extra`` from the first row of an episode that has data rows."""
    return int.from_bytes(np.ascontiguousarray(first)[:_PREFIX].tobytes(), "little")


def gather_data(rows: np.ndarray, extra: bool = False) -> dict:
    """The episode data spread over ``rows`` (``(steps, width)`` uint8) by ``spread``;
    ``extra``: the rows begin with data rows (the stream starts with their count)."""
    flat = np.ascontiguousarray(rows).reshape(-1)
    if extra:
        flat = flat[_PREFIX:]
    n = int.from_bytes(flat[:_PREFIX].tobytes(), "little")
    doc = json.loads(flat[_PREFIX:_PREFIX + n].tobytes())
    return {k: _decode_value(v) for k, v in doc.items()}
