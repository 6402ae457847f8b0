"""Where a sampled batch goes: fresh arrays, or the caller's arrays or tensors."""
from __future__ import annotations

from typing import Any

import numpy as np


class _Target:
    """Where one column of a batch goes: a numpy array, or a tensor via a view."""

    def __init__(self, obj, shape, dtype, name):
        self.result = obj
        self.tensor: Any = None           # a torch.Tensor; torch is imported only if used
        self.array: np.ndarray | None     # None: a tensor off the CPU, written through .tensor
        if obj is None:
            self.array = np.empty(shape, dtype)
            self.result = self.array
            return
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


def prepare_out(out, spec, lead, ids: bool = False):
    """A ``_Target`` per column of a batch with leading dims ``lead`` (and ``"ids"``, int64)."""
    if ids:
        spec = dict(spec, ids=((), np.dtype(np.int64)))
    if out is not None and (not isinstance(out, dict) or out.keys() != spec.keys()):
        raise ValueError(f"out must be a dict with exactly the keys {sorted(spec)}, "
                         f"got {sorted(out) if isinstance(out, dict) else type(out).__name__}")
    targets = {}
    for name, (shape, dtype) in spec.items():
        obj = None if out is None else out[name]
        targets[name] = _Target(obj, lead + shape, dtype, name)
    return targets


def _torch_to_numpy_dtype(dtype):
    import torch

    return torch.empty((), dtype=dtype).numpy().dtype
