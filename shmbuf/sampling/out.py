"""Where a sampled batch goes: fresh arrays, or the caller's arrays or tensors.

``prepare_out`` maps each column to its target: a fresh ``np.ndarray``
(nothing else to know), or a ``_Target`` over the caller's array or tensor.
``array_of``, ``put`` and ``result_of`` read and write either kind.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class _Target:
    """Where one column of a batch goes, in the caller's ``out``: a numpy array, or a
    tensor via a view."""

    __slots__ = ("result", "tensor", "array")

    def __init__(self, obj, shape, dtype, name):
        self.result = obj
        self.tensor: Any = None           # a torch.Tensor; torch is imported only if used
        self.array: np.ndarray | None     # None: a tensor off the CPU, written through .tensor
        if type(obj).__module__.startswith("torch"):
            self.tensor = obj
            self.array = obj.numpy() if obj.device.type == "cpu" else None
            got_shape, got_dtype = tuple(obj.shape), _torch_to_numpy_dtype(obj.dtype)
        else:
            if not isinstance(obj, np.ndarray):
                raise TypeError(f"out[{name!r}] must be a numpy array or torch tensor, "
                                f"got {type(obj).__name__}")
            self.array = obj
            got_shape, got_dtype = obj.shape, obj.dtype
        if got_shape != shape or got_dtype != dtype:
            raise ValueError(f"out[{name!r}] must have shape {shape} and dtype {dtype}, "
                             f"got {got_shape} and {got_dtype}")
        if self.array is not None and not self.array.flags.c_contiguous:
            raise ValueError(f"out[{name!r}] must be C-contiguous")

    def put(self, values, pending, time_major):
        if self.array is not None:
            if time_major:
                self.array[:, pending] = values
            else:
                self.array[pending] = values
            return
        import torch

        rows = torch.from_numpy(pending)
        index = (slice(None), rows) if time_major else rows
        self.tensor[index] = torch.from_numpy(values).to(self.tensor.device)


def prepare_out(out, spec, lead, ids=False) -> dict:
    """Each column's target for a batch with leading dims ``lead``, and ``"ids"``: a
    fresh array where ``out`` is None, else a ``_Target`` over ``out[name]``.

    ``ids``: False, none; True, int64 step ids; or ``(shape, dtype)`` of a
    zeroed record per step whose first 8 bytes take its id (``StorePort.step_ids``'
    ``out``), for a caller's own id layout (fresh arrays only).
    """
    if out is None:
        empty = np.empty
        targets = {name: empty(lead + shape, dtype) for name, (shape, dtype) in spec.items()}
        if ids is True:
            targets["ids"] = empty(lead, np.int64)
        elif ids:
            shape, dtype = ids
            targets["ids"] = np.zeros(lead + shape, dtype)
        return targets
    if ids:
        spec = dict(spec, ids=((), np.dtype(np.int64)))
    if not isinstance(out, dict) or out.keys() != spec.keys():
        raise ValueError(f"out must be a dict with exactly the keys {sorted(spec)}, "
                         f"got {sorted(out) if isinstance(out, dict) else type(out).__name__}")
    return {name: _Target(out[name], lead + shape, dtype, name)
            for name, (shape, dtype) in spec.items()}


def array_of(target) -> np.ndarray | None:
    """The host array a target writes to (None: a tensor off the CPU)."""
    return target if type(target) is np.ndarray else target.array


def put(target, values, pending, time_major) -> None:
    """Write ``values`` to the batch places ``pending`` of ``target``."""
    if type(target) is np.ndarray:
        if time_major:
            target[:, pending] = values
        else:
            target[pending] = values
        return
    target.put(values, pending, time_major)


def result_of(target):
    """What the sample call returns for this target (the caller's object, if given)."""
    return target if type(target) is np.ndarray else target.result


def _torch_to_numpy_dtype(dtype):
    import torch

    return torch.empty((), dtype=dtype).numpy().dtype
