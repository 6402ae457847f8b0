"""What a TorchRL storage holds, as shmbuf columns, and back.

The first element written fixes the schema: a plain tensor, a TensorDict
(nested keys, sub-TensorDicts with batch dims of their own, tensorclasses),
or a pytree of tensors.  ``describe`` turns that element into a JSON schema
and a shmbuf ``spec`` (one column per leaf, named ``c0``, ``c1``, ...; the
leaf's key lives in the schema, since TensorDict keys need not be Python
identifiers); ``build`` turns the schema and the columns' zero-copy tensors
back into a storage-shaped TensorDict / tensor / pytree, the same in every
process.  ``check`` says, before anything is written, how a later element
drifts from the schema.

A storage row is one index along dim 0, so a leaf's column shape is the
element's leaf shape (with ``ndim > 1`` that includes the other storage dims).
"""
from __future__ import annotations

import importlib

import numpy as np
import torch
from tensordict import TensorDict, is_tensor_collection, is_tensorclass
from torch.utils import _pytree

FORMAT = 1
END_COLUMN = "end"   # the hidden scalar column that ends trajectories (stream mode)

# torch dtypes numpy has no name for live as raw bytes of the same width.
_RAW = {torch.bfloat16: np.uint16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _RAW[getattr(torch, _name)] = np.uint8

# Classes seen in this process by their import path: tensorclasses defined in a
# function cannot be imported again, but the process that wrote them knows them.
_CLASSES: dict[str, type] = {}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"schema names the unknown torch dtype {name!r}")
    return dtype


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a column of torch ``dtype`` is kept in (same bytes)."""
    if dtype in _RAW:
        return np.dtype(_RAW[dtype])
    return torch.empty((), dtype=dtype).numpy().dtype


def _class_path(cls: type) -> str:
    path = f"{cls.__module__}:{cls.__qualname__}"
    _CLASSES[path] = cls
    return path


def _class_of(path: str | None):
    """The class at ``path``: one seen here, or imported; None (a plain TensorDict) if neither."""
    if path is None:
        return None
    if path in _CLASSES:
        return _CLASSES[path]
    module, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) else None


def _key(key) -> list[str]:
    return [key] if isinstance(key, str) else list(key)


def _leaf_entry(key, column: str, value: torch.Tensor) -> list:
    return [_key(key), column, dtype_name(value.dtype), list(value.shape)]


def describe(element, ndim: int) -> dict:
    """The JSON schema of one storage element (``data[0]`` of a batch).

    Raises:
        TypeError: a leaf that is not a tensor, or a type the storage cannot hold.
        ValueError: an element with fewer dims than ``ndim - 1``.
    """
    if is_tensor_collection(element):
        schema = _describe_td(element)
        batch = schema["batch"]
    elif isinstance(element, torch.Tensor):
        schema = {"kind": "tensor", "leaves": [_leaf_entry([], "c0", element)]}
        batch = list(element.shape)
    else:
        leaves, spec = _pytree.tree_flatten(element)
        bad = [type(v).__name__ for v in leaves if not isinstance(v, torch.Tensor)]
        if not leaves or bad:
            raise TypeError(f"data: a LazyShmStorage holds tensors, TensorDicts, tensorclasses "
                            f"or pytrees of tensors; got {type(element).__name__} with "
                            f"leaves of types {bad or 'none'}")
        schema = {"kind": "tree", "tree": _pytree.treespec_dumps(spec),
                  "leaves": [_leaf_entry([], f"c{i}", v) for i, v in enumerate(leaves)]}
        batch = list(leaves[0].shape)
    if len(batch) < ndim - 1:
        raise ValueError(f"data: a storage with ndim={ndim} needs elements with at least "
                         f"{ndim - 1} batch dims, got shape {batch}")
    schema["format"] = FORMAT
    return schema


def _describe_td(td) -> dict:
    cls = _class_path(type(td)) if is_tensorclass(td) else None
    inner = td._tensordict if is_tensorclass(td) else td
    root = len(inner.batch_size)
    nodes, leaves = [], []
    for key, value in inner.items(include_nested=True):
        if isinstance(value, torch.Tensor):
            if value.is_nested or value.layout != torch.strided:
                raise TypeError(f"data[{key!r}]: a LazyShmStorage holds dense tensors, got "
                                f"layout {value.layout}")
            leaves.append(_leaf_entry(key, f"c{len(leaves)}", value))
        elif is_tensor_collection(value):
            sub = value._tensordict if is_tensorclass(value) else value
            if type(sub).__name__.startswith("NonTensor"):
                raise TypeError(f"data[{key!r}]: non-tensor data cannot live in shared "
                                "memory; keep it out of the storage (or encode it as a tensor)")
            nodes.append([_key(key), _class_path(type(value)) if is_tensorclass(value) else None,
                          list(sub.batch_size[root:])])
        else:
            raise TypeError(f"data[{key!r}]: cannot hold a {type(value).__name__}")
    if not leaves:
        raise ValueError("data: the first element written holds no tensor; a LazyShmStorage "
                         "makes its columns from the first element's tensors")
    return {"kind": "td", "cls": cls, "batch": list(inner.batch_size), "nodes": nodes,
            "leaves": leaves}


def spec_of(schema: dict) -> dict:
    """The shmbuf ``spec`` of a schema: its leaves' columns and the hidden end column."""
    spec = {col: (tuple(shape), numpy_dtype(torch_dtype(dt)))
            for _, col, dt, shape in schema["leaves"]}
    spec[END_COLUMN] = ((), np.bool_)
    return spec


def build(schema: dict, arrays: dict, capacity: int):
    """The storage-shaped TensorDict / tensor / pytree over the columns ``arrays``."""
    views = []
    for _, col, dt, _ in schema["leaves"]:
        dtype = torch_dtype(dt)
        tensor = torch.from_numpy(arrays[col])
        views.append(tensor.view(dtype) if dtype in _RAW else tensor)
    kind = schema["kind"]
    if kind == "tensor":
        return views[0]
    if kind == "tree":
        return _pytree.tree_unflatten(views, _pytree.treespec_loads(schema["tree"]))
    batch = [capacity, *schema["batch"]]
    root = TensorDict({}, batch_size=batch)
    for key, _, extra in sorted(schema["nodes"], key=lambda n: len(n[0])):
        root.set(tuple(key), TensorDict({}, batch_size=batch + extra))
    for (key, _, _, _), view in zip(schema["leaves"], views):
        root.set(tuple(key), view)
    # Tensorclasses wrap their TensorDicts from the innermost out.
    for key, path, _ in sorted(schema["nodes"], key=lambda n: -len(n[0])):
        cls = _class_of(path)
        if cls is not None:
            root.set(tuple(key), cls.from_tensordict(root.get(tuple(key))))
    cls = _class_of(schema.get("cls"))
    return cls.from_tensordict(root) if cls is not None else root


def drift(schema: dict, element) -> str | None:
    """How ``element`` differs from ``schema`` (keys, shapes, unsafe dtypes), or None if it fits."""
    try:
        other = describe(element, 1)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return compare(schema, other)


def compare(schema: dict, other: dict) -> str | None:
    """How ``other`` differs from ``schema``; a dtype that casts safely (``torch.can_cast``)
    into the stored one fits."""
    if other["kind"] != schema["kind"]:
        return f"the storage holds a {schema['kind']}, got a {other['kind']}"
    if schema["kind"] == "tree":
        if other["tree"] != schema["tree"]:
            return "the pytree's structure differs from the first element's"
        mine = {i: (dt, shape) for i, (_, _, dt, shape) in enumerate(schema["leaves"])}
        theirs = {i: (dt, shape) for i, (_, _, dt, shape) in enumerate(other["leaves"])}
    else:
        mine = {tuple(k): (dt, shape) for k, _, dt, shape in schema["leaves"]}
        theirs = {tuple(k): (dt, shape) for k, _, dt, shape in other["leaves"]}
    missing = sorted(map(str, mine.keys() - theirs.keys()))
    extra = sorted(map(str, theirs.keys() - mine.keys()))
    if missing or extra:
        return f"missing keys {missing}, unexpected keys {extra}"
    for key, (dt, shape) in mine.items():
        odt, oshape = theirs[key]
        if oshape != shape:
            return f"key {key}: shape {tuple(oshape)} where the storage holds {tuple(shape)}"
        if odt != dt and not torch.can_cast(torch_dtype(odt), torch_dtype(dt)):
            return f"key {key}: dtype {odt} does not cast safely to the stored {dt}"
    return None
