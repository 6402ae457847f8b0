"""Minari datasets in and out, under ``shmbuf.gym``'s step convention.

A Minari episode of N steps stores N + 1 observations and N actions,
rewards, terminations and truncations.  It becomes N + 1 rows: row 0 holds
the first observation with a blank action, reward 0 and ``is_first``; row
t holds observation t with the action and reward that led to it, and
``done`` is the termination.  A truncated episode (or one that ends with
neither flag) ends with ``Writer.end_episode``: a cut, not a terminal.  One
more bool column, ``truncated``, keeps Minari's truncation flag as it was
(gymnasium lets a step be both terminated and truncated), so that nothing is
inferred on the way back.
Columns keep the dtypes Minari stored, so the way back is bit-identical.
"""
from __future__ import annotations

import types
import warnings

import numpy as np

from ..gym import spec_for
from ..gym._spaces import leaves
from ..protocol.layout import default_episode_slots
from ..store import buffer as store
from ._common import (
    BLOCK_BYTES,
    DatasetFormatError,
    block_rows,
    check_progress,
    filling,
    finished_episodes,
    keep_newest,
    progress_bar,
)

_CONVENTION = ("reward", "is_first", "done")
TRUNCATED = "truncated"  # Minari's flag, row by row (row 0: False); see the module docstring


def _open(dataset, download: bool = False):
    import minari

    if not isinstance(download, bool):
        raise TypeError(f"from_minari: download must be True or False, got {download!r}")
    if isinstance(dataset, str):
        return minari.load_dataset(dataset, download=download)
    if not isinstance(dataset, minari.MinariDataset):
        raise TypeError(f"dataset must be a minari.MinariDataset or a local dataset id (str), "
                        f"got {type(dataset).__name__}")
    return dataset


def _observation_space(ds, keys):
    from gymnasium import spaces

    space = ds.observation_space
    if keys is None:
        return space
    if not isinstance(space, spaces.Dict):
        raise ValueError(f"from_minari: keys={keys!r} selects keys of a Dict observation space, "
                         f"but dataset {ds.id!r} observes {space}")
    unknown = sorted(set(keys) - set(space.spaces))
    if unknown or not keys:
        raise KeyError(f"from_minari: keys {unknown or list(keys)} name no observation of "
                       f"dataset {ds.id!r}; its keys are {list(space.spaces)}")
    return spaces.Dict({k: space.spaces[k] for k in keys})


def _selected(ds, episodes) -> np.ndarray:
    ids = np.asarray(ds.episode_indices, np.int64)
    if episodes is None:
        return ids
    wanted = np.asarray(list(episodes), np.int64)
    unknown = sorted(set(wanted.tolist()) - set(ids.tolist()))
    if unknown:
        raise ValueError(f"from_minari: episodes {unknown[:10]} are not episodes of dataset "
                         f"{ds.id!r} (it has {len(ids)}, ids {ids[:3].tolist()}...)")
    return wanted


def _columns_of(ep, obs_leaves, act_leaves) -> tuple[dict, dict]:
    """``{column: array}`` of an episode's observations and of its actions."""
    obs = {leaf.name: np.asarray(leaf.pick(ep.observations)) for leaf in obs_leaves}
    act = {leaf.name: np.asarray(leaf.pick(ep.actions)) for leaf in act_leaves}
    return obs, act


def _spec(ds, obs_space, first_episode) -> dict:
    """spec_for's columns with the dtypes (and checked shapes) Minari stored."""
    spec = spec_for(types.SimpleNamespace(observation_space=obs_space,
                                          action_space=ds.action_space))
    obs, act = _columns_of(first_episode, leaves(obs_space, "obs"),
                           leaves(ds.action_space, "action"))
    stored = dict(obs, **act, reward=np.asarray(first_episode.rewards))
    for name, array in stored.items():
        shape = spec[name][0]
        if array.shape[1:] != tuple(shape):
            raise DatasetFormatError(
                f"from_minari: dataset {ds.id!r} stores column {name!r} with per-step shape "
                f"{array.shape[1:]}, but its space says {tuple(shape)}; the dataset is "
                "inconsistent with its own spaces")
        spec[name] = (shape, array.dtype)
    spec[TRUNCATED] = ((), np.dtype(np.bool_))
    return spec


def _meta(ds, obs_space) -> dict:
    """The buffer's record of where the data came from, the spaces included (any size).

    Raises:
        ValueError: Minari cannot serialise a space (nothing is created): a
            buffer that dropped its spaces could not be written back as the
            same dataset.
    """
    from minari.serialization import serialize_space

    try:
        return {"source": "minari", "id": ds.id,
                "observation_space": serialize_space(obs_space, to_string=False),
                "action_space": serialize_space(ds.action_space, to_string=False)}
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise ValueError(f"from_minari: dataset {ds.id!r}'s spaces cannot be recorded with "
                         f"the buffer ({type(exc).__name__}: {exc}); nothing was created") from exc


def from_minari(dataset, *, name: str | None = None, capacity: int | None = None,
                episodes=None, keys=None, seed=None, progress: bool | None = None,
                block_bytes: int = BLOCK_BYTES, download: bool = False):
    """A new buffer holding a Minari dataset's episodes, oldest first (this process owns it).

    Rows follow ``shmbuf.gym``'s step convention (module docstring): an
    episode of N steps is N + 1 rows, ``done`` is its termination, a
    truncation is an ``end_episode`` cut, and a ``truncated`` column keeps
    Minari's truncation flag as stored.  Columns come from
    ``shmbuf.gym.spec_for`` on the dataset's spaces, with the dtypes Minari
    stored.  Episodes are copied with ``Writer.extend`` in blocks of at most
    ``block_bytes``, one episode read at a time.  Per-episode infos, seeds
    and options are not carried.

    Args:
        dataset: a ``minari.MinariDataset``, or the id of a local dataset
            (``minari.load_dataset``; ``MINARI_DATASETS_PATH`` applies).
        name: the segment's name; generated if None.
        capacity: rows the buffer holds; default exactly the dataset's.  A
            smaller one keeps the newest whole episodes and warns
            (``CapacityWarning``) how many it left out.
        episodes: ids of the episodes to import (default all), in the order
            given.
        keys: for a Dict observation space, the observation keys to keep.
        seed: the buffer's sampling seed, as in ``shmbuf.create``.
        progress: a tqdm bar on stderr: None (default) if it is a terminal.
        block_bytes: RAM held for one block of rows.
        download: fetch a dataset id that is not held locally from Minari's
            remote (``minari.load_dataset(id, download=True)``).

    Returns:
        The owning ``Buffer``: closing it unlinks it.

    Raises:
        UnsupportedSpaceError: a space with no fixed shape and dtype (Text,
            Graph, ...); nothing is created.
        DatasetFormatError: an episode inconsistent with itself (observation
            and action counts, a termination before its end); the buffer is
            removed again.
        ValueError / KeyError / TypeError: a bad argument; nothing is created.

    Example:
        >>> buf = shmbuf.datasets.from_minari("cartpole/random-v0", name="cartpole")
        >>> buf.sample_sequences(32, 16)["obs"].shape       # (16, 32, 4)
    """
    check_progress(progress)
    ds = _open(dataset, download)
    obs_space = _observation_space(ds, keys)
    ids = _selected(ds, episodes)
    steps = np.array([int(m["total_steps"]) for m in ds.storage.get_episode_metadata(ids)],
                     np.int64) if len(ids) else np.zeros(0, np.int64)
    first, capacity = keep_newest(steps + 1, capacity, "from_minari")
    ids, steps = ids[first:], steps[first:]
    spec = _spec(ds, obs_space, next(ds.iterate_episodes(ids[:1])))
    block = block_rows(spec, block_bytes)
    slots = min(capacity, max(default_episode_slots(capacity), len(ids)))
    buf = store.create(spec, capacity, name=name, seed=seed, meta=_meta(ds, obs_space),
                       prefault=False,
                       episode_slots=slots)
    obs_leaves, act_leaves = leaves(obs_space, "obs"), leaves(ds.action_space, "action")
    with filling(buf) as writer, progress_bar(int(steps.sum() + len(ids)), "from_minari",
                                              progress) as bar:
        for ep in ds.iterate_episodes(ids):
            _write_episode(writer, ds.id, ep, obs_leaves, act_leaves, spec, block, bar)
    return buf


def _write_episode(writer, dataset_id, ep, obs_leaves, act_leaves, spec, block, bar) -> None:
    obs, act = _columns_of(ep, obs_leaves, act_leaves)
    n = len(ep.rewards)
    term = np.asarray(ep.terminations, np.bool_)
    trunc = np.asarray(ep.truncations, np.bool_)
    counts = {**{k: len(v) - 1 for k, v in obs.items()}, **{k: len(v) for k, v in act.items()},
              "terminations": len(term), "truncations": len(trunc)}
    if n < 1 or any(c != n for c in counts.values()):
        raise DatasetFormatError(
            f"from_minari: episode {ep.id} of dataset {dataset_id!r} has {n} rewards but "
            f"counts {counts} (observations minus one, the rest as stored); a Minari episode "
            "of N steps stores N + 1 observations and N of everything else")
    if term[:-1].any() or trunc[:-1].any():
        raise DatasetFormatError(
            f"from_minari: episode {ep.id} of dataset {dataset_id!r} terminates or truncates "
            f"at step {int(np.flatnonzero(term[:-1] | trunc[:-1])[0])} of {n}, before its end")
    rewards = np.asarray(ep.rewards)
    for a in range(0, n + 1, block):
        b = min(a + block, n + 1)
        rows = {k: v[a:b] for k, v in obs.items()}
        for key, src in list(act.items()) + [("reward", rewards)]:
            col = np.empty((b - a,) + src.shape[1:], spec[key][1])
            lo = max(a, 1)
            col[:lo - a] = 0              # row 0: nothing led to the first observation
            col[lo - a:] = src[lo - 1:b - 1]
            rows[key] = col
        rows["is_first"] = np.arange(a, b) == 0
        rows["done"] = (np.arange(a, b) == n) & bool(term[-1])
        rows[TRUNCATED] = (np.arange(a, b) == n) & bool(trunc[-1])
        writer.extend(**rows)
        bar.update(b - a)
    if not term[-1]:
        writer.end_episode()


def _assemble(space, columns: dict, prefix: str):
    """The nested value of ``space`` (Dict, Tuple, leaf) from its leaf columns."""
    names = iter(leaf.name for leaf in leaves(space, prefix))
    from gymnasium import spaces

    def build(sp):
        if isinstance(sp, spaces.Dict):
            return {k: build(sub) for k, sub in sp.spaces.items()}
        if isinstance(sp, spaces.Tuple):
            return tuple(build(sub) for sub in sp.spaces)
        return columns[next(names)]

    return build(space)


def _spaces_for(buffer, observation_space, action_space):
    from gymnasium import spaces
    from minari.serialization import deserialize_space

    meta = buffer.meta
    if observation_space is None and "observation_space" in meta:
        observation_space = deserialize_space(meta["observation_space"])
    if action_space is None and "action_space" in meta:
        action_space = deserialize_space(meta["action_space"])
    spec = buffer.spec
    for which, space in (("observation", observation_space), ("action", action_space)):
        if space is None:
            prefix = "obs" if which == "observation" else "action"
            if prefix not in spec:
                raise ValueError(
                    f"to_minari: buffer {buffer.name!r} records no {which} space and has no "
                    f"{prefix!r} column to make a Box of; pass {which}_space=")
            shape, dtype = spec[prefix]
            space = spaces.Box(-np.inf, np.inf, shape, dtype) if dtype.kind == "f" else \
                spaces.Box(np.iinfo(dtype).min if dtype.kind in "iu" else 0,
                           np.iinfo(dtype).max if dtype.kind in "iu" else 1, shape, dtype)
        if which == "observation":
            observation_space = space
        else:
            action_space = space
    want = {leaf.name for leaf in leaves(observation_space, "obs") + leaves(action_space, "action")}
    missing = sorted(want.union(_CONVENTION) - set(spec))
    if missing:
        raise ValueError(f"to_minari: buffer {buffer.name!r} has columns {sorted(spec)}, but "
                         f"the spaces and the step convention need {sorted(missing)} too; is "
                         "it a shmbuf.gym buffer (spec_for)?")
    return observation_space, action_space


def to_minari(buffer, dataset_id: str, *, episodes=None, observation_space=None,
              action_space=None, description: str | None = None,
              progress: bool | None = None, block_bytes: int = BLOCK_BYTES):
    """Write a buffer's finished episodes as a new Minari dataset (``minari.load_dataset``).

    The inverse of ``from_minari``: rows 1..N of an episode become its N
    steps, row 0's observation its first; ``done`` on the last row is the
    termination; the truncations are the ``truncated`` column where the
    buffer has one (``from_minari``), else an episode that ended by a cut is
    truncated.  Observations
    are stored raw (no JPEG), so Minari -> shmbuf -> Minari is bit-identical
    in observations, actions, rewards, terminations and truncations.
    Episodes go to disk in groups of about ``block_bytes``.

    Args:
        buffer: a buffer under ``shmbuf.gym``'s convention (``from_minari``
            or a recorder made it); attached is fine.
        dataset_id: the new dataset's id, e.g. ``"cartpole/shmbuf-v0"``.
        episodes: episode-index numbers (``buffer.episodes().index``) to
            write; default every finished episode held, oldest first.
        observation_space: default the one ``from_minari`` recorded, else a
            Box over the ``obs`` column.
        action_space: default the one ``from_minari`` recorded, else a Box
            over the ``action`` column.
        description: the dataset's description.

    Returns:
        The new ``minari.MinariDataset``.

    Raises:
        ValueError: no finished episodes, episodes not held, or columns that
            do not match the spaces; nothing is written.
        DatasetFormatError: an episode read back does not start with
            ``is_first``; the partial dataset is deleted.

    Example:
        >>> ds = shmbuf.datasets.to_minari(buf, "cartpole/replay-v0")
        >>> ds.total_episodes
    """
    import minari

    check_progress(progress)
    obs_space, act_space = _spaces_for(buffer, observation_space, action_space)
    wanted = finished_episodes(buffer, episodes, "to_minari")
    obs_names = [leaf.name for leaf in leaves(obs_space, "obs")]
    act_names = [leaf.name for leaf in leaves(act_space, "action")]
    row_cap = block_rows(buffer.spec, block_bytes)
    dataset = None
    try:
        pending, rows, skipped = [], 0, 0
        with progress_bar(len(wanted), "to_minari", progress) as bar:
            for index in wanted:
                ep = buffer.read_episode(index)
                if ep is None:
                    raise ValueError(f"to_minari: episode {index} of buffer {buffer.name!r} "
                                     "was recycled while it was being written")
                if len(ep["done"]) < 2:
                    skipped += 1  # a reset and nothing else: Minari has no 0-step episode
                    continue
                pending.append(_episode_buffer(buffer, index, ep, obs_space, act_space,
                                               obs_names, act_names))
                rows += len(ep["done"])
                bar.update(1)
                if rows >= row_cap:
                    dataset = _flush(dataset, dataset_id, pending, obs_space, act_space,
                                     description or f"exported from shmbuf buffer {buffer.name}")
                    pending, rows = [], 0
            if pending or dataset is None:
                dataset = _flush(dataset, dataset_id, pending, obs_space, act_space,
                                 description or f"exported from shmbuf buffer {buffer.name}")
    except BaseException:
        if dataset is not None:
            minari.delete_dataset(dataset_id)
        raise
    if skipped:
        warnings.warn(f"to_minari: left out {skipped} episodes of a single row (a reset and no "
                      "step): Minari stores no 0-step episode", stacklevel=2)
    return dataset


def _episode_buffer(buffer, index, ep, obs_space, act_space, obs_names, act_names):
    from minari.data_collector import EpisodeBuffer

    if not ep["is_first"][0]:
        raise DatasetFormatError(f"to_minari: episode {index} of buffer {buffer.name!r} does "
                                 "not begin with is_first (its first row was not recorded "
                                 "as a reset); it cannot be written as a Minari episode")
    n = len(ep["done"]) - 1
    if TRUNCATED in ep:   # from_minari kept the flag itself
        trunc = ep[TRUNCATED][1:].astype(np.bool_)
    else:                 # a recorder's buffer: a cut is a truncation
        trunc = np.zeros(n, np.bool_)
        trunc[-1:] = not ep["done"][-1]
    return EpisodeBuffer(
        observations=_assemble(obs_space, {k: ep[k] for k in obs_names}, "obs"),
        actions=_assemble(act_space, {k: ep[k][1:] for k in act_names}, "action"),
        rewards=ep["reward"][1:], terminations=ep["done"][1:].astype(np.bool_),
        truncations=trunc)


def _flush(dataset, dataset_id, pending, obs_space, act_space, description):
    """Create the dataset with the first group, then append to it."""
    import minari

    if dataset is not None:
        dataset.update_dataset_from_buffer(pending)
        return dataset
    with warnings.catch_warnings():
        # minari's advice to set author and permalink
        warnings.filterwarnings("ignore", category=UserWarning, module="minari")
        return minari.create_dataset_from_buffers(
            dataset_id, pending, observation_space=obs_space, action_space=act_space,
            description=description, jpeg_encoding=False)


__all__ = ["from_minari", "to_minari"]
