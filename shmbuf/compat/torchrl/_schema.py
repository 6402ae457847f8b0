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

import functools
import importlib

import numpy as np
import torch
from tensordict import (
    LazyStackedTensorDict,
    TensorDict,
    is_non_tensor,
    is_tensor_collection,
    is_tensorclass,
)
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


@functools.lru_cache(maxsize=None)
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
    if _ragged(element):
        schema = _describe_lazy(element)
        batch = schema["batch"]
    elif is_tensor_collection(element):
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


def _ragged(element) -> bool:
    """A lazy stack whose parts differ in shape: no dense view of it exists."""
    if not isinstance(element, LazyStackedTensorDict):
        return False
    shapes = [{k: tuple(v.shape) for k, v in part.items(True, True)}
              for part in element.tensordicts]
    return any(s != shapes[0] for s in shapes[1:])


def _describe_lazy(stack) -> dict:
    """A ragged lazy stack: each part's columns apart, stacked again by ``build``."""
    parts: list[dict] = []
    leaves: list[list] = []
    for part in stack.tensordicts:
        sub = _describe_td(part, first=len(leaves))
        parts.append(sub)
        leaves.extend(sub["leaves"])
    return {"kind": "lazy", "stack_dim": stack.stack_dim, "batch": list(stack.batch_size),
            "parts": parts, "leaves": leaves}


def _describe_td(td, first: int = 0) -> dict:
    cls = _class_path(type(td)) if is_tensorclass(td) else None
    inner = td._tensordict if is_tensorclass(td) else td
    root = len(inner.batch_size)
    nodes: list[list] = []
    leaves: list[list] = []
    local: list[list] = []
    for key, value in inner.items(include_nested=True, is_leaf=_stops_at_non_tensor):
        if is_non_tensor(value):
            local.append(_key(key))   # strings and objects: kept by each process (local_part)
        elif isinstance(value, torch.Tensor):
            if value.is_nested or value.layout != torch.strided:
                raise TypeError(f"data[{key!r}]: a LazyShmStorage holds dense tensors, got "
                                f"layout {value.layout}")
            leaves.append(_leaf_entry(key, f"c{first + len(leaves)}", value))
        elif is_tensor_collection(value):
            sub = value._tensordict if is_tensorclass(value) else value
            nodes.append([_key(key), _class_path(type(value)) if is_tensorclass(value) else None,
                          list(sub.batch_size[root:])])
        else:
            raise TypeError(f"data[{key!r}]: cannot hold a {type(value).__name__}")
    if not leaves:
        raise ValueError("data: the first element written holds no tensor; a LazyShmStorage "
                         "makes its columns from the first element's tensors")
    return {"kind": "td", "cls": cls, "batch": list(inner.batch_size), "nodes": nodes,
            "leaves": leaves, "local": local}


def _stops_at_non_tensor(cls) -> bool:
    """``items``' leaf rule: tensors, and non-tensor data (which ``items`` would enter)."""
    return issubclass(cls, torch.Tensor) or getattr(cls, "_is_non_tensor", False)


def local_part(schema: dict, element, capacity: int):
    """The storage-shaped non-tensor entries of ``element`` (None if it has none), made the
    way TorchRL's ``LazyTensorStorage`` makes them: they stay in the process that holds them."""
    keys = [tuple(k) for k in schema.get("local", [])]
    if not keys:
        return None
    inner = element._tensordict if is_tensorclass(element) else element
    picked = inner.select(*keys)
    return torch.empty_like(picked.expand(capacity, *picked.shape))


def merge_local(views, local) -> None:
    """Put the process-local entries ``local`` beside the shared columns of ``views``."""
    if local is not None:
        inner = views._tensordict if is_tensorclass(views) else views
        inner.update(local)


def take_local(schema: dict, views):
    """The current process-local entries of ``views`` (writes may have replaced them)."""
    keys = [tuple(k) for k in schema.get("local", [])]
    if not keys or views is None:
        return None
    inner = views._tensordict if is_tensorclass(views) else views
    return inner.select(*keys, strict=False)


def index(views, idx):
    """``views[idx]`` for every kind ``build`` makes (a pytree's leaves indexed one by one)."""
    if is_tensor_collection(views) or isinstance(views, torch.Tensor):
        return views[idx]
    return _pytree.tree_map(lambda leaf: leaf[idx], views)


def spec_of(schema: dict) -> dict:
    """The shmbuf ``spec`` of a schema: its leaves' columns and the hidden end column."""
    spec = {col: (tuple(shape), numpy_dtype(torch_dtype(dt)))
            for _, col, dt, shape in schema["leaves"]}
    spec[END_COLUMN] = ((), np.dtype(np.bool_))
    return spec


def build(schema: dict, arrays: dict, capacity: int):
    """The storage-shaped TensorDict / tensor / pytree over the columns ``arrays``."""
    views = {}
    for _, col, dt, _ in schema["leaves"]:
        dtype = torch_dtype(dt)
        tensor = torch.from_numpy(arrays[col])
        views[col] = tensor.view(dtype) if dtype in _RAW else tensor
    kind = schema["kind"]
    if kind == "tensor":
        return views["c0"]
    if kind == "tree":
        return _pytree.tree_unflatten([views[col] for _, col, _, _ in schema["leaves"]],
                                      _pytree.treespec_loads(schema["tree"]))
    if kind == "lazy":
        return LazyStackedTensorDict(*[_build_td(part, views, capacity)
                                       for part in schema["parts"]],
                                     stack_dim=schema["stack_dim"] + 1)
    return _build_td(schema, views, capacity)


def _build_td(schema: dict, views: dict, capacity: int):
    batch = [capacity, *schema["batch"]]
    root = TensorDict({}, batch_size=batch)
    for key, _, extra in sorted(schema["nodes"], key=lambda n: len(n[0])):
        root.set(tuple(key), TensorDict({}, batch_size=batch + extra))
    for key, col, _, _ in schema["leaves"]:
        root.set(tuple(key), views[col])
    # Tensorclasses wrap their TensorDicts from the innermost out.
    for key, path, _ in sorted(schema["nodes"], key=lambda n: -len(n[0])):
        cls = _class_of(path)
        if cls is not None:
            root.set(tuple(key), cls.from_tensordict(root.get(tuple(key))))
    cls = _class_of(schema.get("cls"))
    return cls.from_tensordict(root) if cls is not None else root


def drift(schema: dict, element, *, exact: bool) -> str | None:
    """How ``element`` differs from ``schema``, or None if it fits.

    Keys both hold must agree in shape, and in dtype up to a safe cast
    (``torch.can_cast``).  ``exact``: the keys must be the same too (a
    ``ShmWriter`` step fills every column); otherwise missing keys are left
    untouched and new ones grow the storage (``grow``), as TorchRL's
    ``LazyTensorStorage`` does.
    """
    try:
        other = describe(element, 1)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return compare(schema, other, exact=exact)


def _leaf_table(schema: dict) -> dict:
    if schema["kind"] == "tree":
        return {i: (dt, shape) for i, (_, _, dt, shape) in enumerate(schema["leaves"])}
    return {tuple(k): (dt, shape) for k, _, dt, shape in schema["leaves"]}


def compare(schema: dict, other: dict, *, exact: bool) -> str | None:
    """How ``other`` (a described element) differs from ``schema`` (see ``drift``)."""
    if other["kind"] != schema["kind"]:
        return f"the storage holds a {schema['kind']}, got a {other['kind']}"
    if schema["kind"] == "tree" and other["tree"] != schema["tree"]:
        return "the pytree's structure differs from the first element's"
    if schema["kind"] == "lazy":
        if len(other["parts"]) != len(schema["parts"]) or other["stack_dim"] != schema[
                "stack_dim"]:
            return "the lazy stack's parts differ from the first element's"
        for mine_part, their_part in zip(schema["parts"], other["parts"]):
            why = compare(dict(mine_part, kind="td"), dict(their_part, kind="td"), exact=exact)
            if why is not None:
                return why
        return None
    mine, theirs = _leaf_table(schema), _leaf_table(other)
    if exact:
        missing = sorted(map(str, mine.keys() - theirs.keys()))
        extra = sorted(map(str, theirs.keys() - mine.keys()))
        if missing or extra:
            return (f"missing keys {missing}, unexpected keys {extra} (the storage holds "
                    f"{sorted(map(str, mine))}; select the keys to keep, or write them from "
                    "the first batch on)")
    # An element may index deeper than dim 0 (a tuple cursor with ndim > 1): it must
    # match the end of the stored shape.
    for key in mine.keys() & theirs.keys():
        (dt, shape), (odt, oshape) = mine[key], theirs[key]
        fits = oshape == shape if exact else len(oshape) <= len(shape) and (
            not oshape or shape[-len(oshape):] == oshape)
        if not fits:
            return f"key {key}: shape {tuple(oshape)} where the storage holds {tuple(shape)}"
        if odt != dt and not torch.can_cast(torch_dtype(odt), torch_dtype(dt)):
            return f"key {key}: dtype {odt} does not cast safely to the stored {dt}"
    return None


def grow(schema: dict, element) -> dict | None:
    """``schema`` with the keys of ``element`` it lacks (new columns), or None if none."""
    if schema["kind"] != "td":
        return None
    other = describe(element, 1)
    have = {tuple(k) for k, _, _, _ in schema["leaves"]}
    new = [entry for entry in other["leaves"] if tuple(entry[0]) not in have]
    if not new:
        return None
    used = max(int(col[1:]) for _, col, _, _ in schema["leaves"])
    leaves = list(schema["leaves"])
    for i, (key, _, dt, shape) in enumerate(new, start=used + 1):
        leaves.append([key, f"c{i}", dt, shape])
    nodes = {tuple(k): [k, c, b] for k, c, b in schema["nodes"]}
    for k, c, b in other["nodes"]:
        nodes.setdefault(tuple(k), [k, c, b])
    return dict(schema, leaves=leaves, nodes=list(nodes.values()),
                local=schema.get("local", []))
