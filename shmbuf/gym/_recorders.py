"""Recorders: gymnasium wrappers that write every step of every episode into a buffer.

They follow the step convention of ``shmbuf.gym`` (one row per observation,
holding the action and reward that led to it).  The row builder turns env
values into rows; a sink writes rows into env streams; the wrappers keep
track of which episodes are open and when to cut.
"""
from __future__ import annotations

import contextlib
import warnings

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode, VectorWrapper

from .._errors import BufferClosedError, WritersStoppedError
from . import _spaces
from ._spaces import CONVENTION


class _Rows:
    """Builds the convention's rows for one buffer from what an env returns."""

    def __init__(self, buffer, observation_space, action_space, who: str):
        self.obs, self.act = _spaces.columns(observation_space, action_space)
        want = {leaf.name for leaf in self.obs + self.act} | set(CONVENTION)
        have = buffer.spec
        if set(have) == want:  # a supported space fixes the shape; an override may change dtypes
            want_shapes = {leaf.name: _spaces.column_of(leaf)[0] for leaf in self.obs + self.act
                           if isinstance(leaf.space, _spaces.SUPPORTED)}
            if any(have[name][0] != shape for name, shape in want_shapes.items()):
                want = {f"{name}{shape}" for name, shape in want_shapes.items()}
                have = {f"{name}{have[name][0]}" for name in want_shapes}
        if set(have) != want or buffer.done_key != "done":
            raise ValueError(
                f"{who}: buffer {buffer.name!r} has columns {sorted(have)} (done_key "
                f"{buffer.done_key!r}), but this env's spaces need {sorted(want)} with "
                "done_key 'done'; create the buffer with shmbuf.create(shmbuf.gym.spec_for(env), "
                "capacity)")
        self.blank = {leaf.name: np.zeros(*have[leaf.name]) for leaf in self.act}
        self._blank_batch: dict = {}

    def first(self, obs) -> dict:
        """The row of a reset observation: no action, no reward, ``is_first``."""
        return self.first_of({leaf.name: leaf.pick(obs) for leaf in self.obs})

    def first_of(self, obs_columns: dict) -> dict:
        """``first`` from the observation's columns."""
        row = dict(obs_columns)
        row.update(self.blank)
        row.update(reward=0.0, is_first=True, done=False)
        return row

    def step(self, obs, action, reward, terminal: bool) -> dict:
        """The row of an observation that ``action`` led to, with its reward."""
        row = {leaf.name: leaf.pick(obs) for leaf in self.obs}
        for leaf in self.act:
            row[leaf.name] = leaf.pick(action)
        row.update(reward=reward, is_first=False, done=bool(terminal))
        return row

    def first_batch(self, obs, n: int) -> dict:
        """``first`` for every env of a vector env, each column with a leading env axis."""
        if n not in self._blank_batch:
            blank = {k: np.broadcast_to(v, (n,) + v.shape) for k, v in self.blank.items()}
            blank.update(reward=np.zeros(n, np.float32), is_first=np.ones(n, np.bool_),
                         done=np.zeros(n, np.bool_))
            self._blank_batch[n] = blank
        cols = {leaf.name: np.asarray(leaf.pick(obs)) for leaf in self.obs}
        cols.update(self._blank_batch[n])
        return cols

    def step_batch(self, obs, actions, rewards, terminal, first) -> dict:
        """``step`` for every env; rows of ``first`` envs are ``first`` rows instead.

        (In next-step autoreset, an env that ended on the previous call was
        reset by this one: its action was ignored and its reward is 0.)
        """
        some_first = bool(first.any())
        cols = {leaf.name: np.asarray(leaf.pick(obs)) for leaf in self.obs}
        for leaf in self.act:
            action = np.asarray(leaf.pick(actions))
            if some_first:
                action = action.copy()
                action[first] = self.blank[leaf.name]
            cols[leaf.name] = action
        rewards = np.asarray(rewards)
        cols["reward"] = np.where(first, 0, rewards) if some_first else rewards
        cols["is_first"] = first
        cols["done"] = terminal & ~first
        return cols

    def replace_obs(self, row: dict, obs) -> dict:
        """``row`` with the observation columns of ``obs`` (one env's value)."""
        row = dict(row)
        for leaf in self.obs:
            row[leaf.name] = leaf.pick(obs)
        return row


def _one(cols: dict, i: int) -> dict:
    return {k: v[i] for k, v in cols.items()}


class _BatchSink:
    """One writer, one stream per env, whole batches only (``add_batch``)."""

    def __init__(self, buffer, n: int):
        self.writer = buffer.writer()

    def add_all(self, cols: dict) -> None:
        self.writer.add_batch(**cols)

    def cut(self, i: int) -> None:
        self.writer.end_episode(int(i))

    def close(self) -> None:
        self.writer.close()


class _PerEnvSink:
    """One writer per env (``add``), for modes whose calls write rows of some envs only."""

    def __init__(self, buffer, n: int):
        self.writers = []
        try:
            for _ in range(n):
                self.writers.append(buffer.writer())
        except BaseException:
            self.close()
            raise

    def add(self, i: int, row: dict) -> None:
        self.writers[i].add(**row)

    def add_all(self, cols: dict) -> None:
        for i, w in enumerate(self.writers):
            w.add(**_one(cols, i))

    def cut(self, i: int) -> None:
        self.writers[int(i)].end_episode()

    def close(self) -> None:
        for w in self.writers:
            w.close()


class RecordEpisodes(gym.Wrapper):
    """Record every step of a single env into ``buffer``, in the process that steps it.

    An ordinary wrapper: ``reset``, ``step``, ``close``, spaces and infos pass
    through unchanged, so it composes with ``RecordEpisodeStatistics`` and
    friends.  ``reset`` writes the first row of an episode (cutting the
    previous one if it was still open); ``step`` writes the row of the
    observation it returns; a terminal step sets ``done``; a truncated one
    cuts the episode (``Writer.end_episode``), not terminal.

    Args:
        env: a ``gymnasium.Env``.
        buffer: a ``shmbuf.Buffer`` created with ``spec_for(env)`` (an
            attached one in an actor process).

    Raises:
        ValueError: the buffer's columns are not ``spec_for(env)``'s.

    Example:
        >>> env = RecordEpisodes(gym.make("CartPole-v1"), buf)
        >>> obs, info = env.reset(seed=0)
        >>> obs, r, term, trunc, info = env.step(env.action_space.sample())
    """

    def __init__(self, env: gym.Env, buffer):
        super().__init__(env)
        self._rows = _Rows(buffer, env.observation_space, env.action_space, "RecordEpisodes")
        self._writer = buffer.writer()
        self._open = False
        self._stepped = False   # the open episode has a step besides its reset row
        self._closed = False

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        if self._open:
            self._writer.end_episode()  # reset mid-episode: the episode is cut
        self._writer.add(**self._rows.first(obs))
        self._open, self._stepped = True, False
        return obs, info

    def step(self, action):
        if not self._open:
            raise ResetNeeded("RecordEpisodes: the episode has ended (or never began); "
                              "call reset() before step()")
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._writer.add(**self._rows.step(obs, action, reward, terminated))
        self._stepped = True
        if terminated or truncated:
            self._open = False
            if not terminated:
                self._writer.end_episode()
        return obs, reward, terminated, truncated, info

    def close(self):
        """Cut the open episode and close the writer (never the buffer), then the env.

        An episode that is only its reset row (``reset`` then ``close``, the
        end of gymnasium's usual loop) is not cut: it has no step, and cutting
        it would index a 0-step episode that ``count_episodes`` and
        ``uniform="episodes"`` would count.
        """
        if not self._closed:
            self._closed = True
            with contextlib.suppress(BufferClosedError, WritersStoppedError):
                if self._open and self._stepped:
                    self._writer.end_episode()
            self._open = False
            self._writer.close()
        super().close()


def autoreset_mode(env) -> AutoresetMode:
    """The autoreset mode a vector env declares (``NEXT_STEP`` if it declares none)."""
    mode = env.metadata.get("autoreset_mode")
    if mode is None:
        warnings.warn(f"{env} declares no metadata['autoreset_mode']; RecordVectorEpisodes "
                      "assumes NEXT_STEP, as gymnasium does", stacklevel=3)
        return AutoresetMode.NEXT_STEP
    return mode if isinstance(mode, AutoresetMode) else AutoresetMode(mode)


class RecordVectorEpisodes(VectorWrapper):
    """Record every step of every sub-env of a vector env into ``buffer``: one stream each.

    Works with sync and async vector envs in every autoreset mode:

    - ``NEXT_STEP`` (gymnasium's default): one ``add_batch`` per call.  The
      call after an episode ended resets that sub-env: its row is the new
      episode's first row (the action passed for it is ignored and not
      stored), never a transition.
    - ``SAME_STEP``: the final observation comes from ``info["final_obs"]``;
      the reset observation returned in its place starts the next episode.
    - ``DISABLED``: ``reset(options={"reset_mask": mask})`` starts the next
      episodes of the masked sub-envs.

    In the last two modes a call can write rows of some sub-envs only, so
    each sub-env gets its own writer (``add``; one writer slot each).  Like
    ``RecordEpisodes`` it is an ordinary wrapper and records in the process
    that calls ``step``; ``close()`` closes the writers, not the buffer.

    Args:
        env: a ``gymnasium.vector.VectorEnv``.
        buffer: a ``shmbuf.Buffer`` created with ``spec_for(env)``.

    Raises:
        ValueError: the buffer's columns are not ``spec_for(env)``'s.

    Example:
        >>> envs = RecordVectorEpisodes(gym.make_vec("CartPole-v1", num_envs=8), buf)
        >>> obs, info = envs.reset(seed=0)
        >>> obs, r, term, trunc, info = envs.step(envs.action_space.sample())
    """

    def __init__(self, env, buffer):
        super().__init__(env)
        self._mode = autoreset_mode(env)
        self._rows = _Rows(buffer, env.single_observation_space, env.single_action_space,
                           "RecordVectorEpisodes")
        n = self._n = env.num_envs
        sink = _BatchSink if self._mode == AutoresetMode.NEXT_STEP else _PerEnvSink
        self._sink = sink(buffer, n)
        self._open = np.zeros(n, np.bool_)    # a sub-env's episode has rows and no end yet
        self._stepped = np.zeros(n, np.bool_)  # ... and a step besides its reset row
        self._ended = np.zeros(n, np.bool_)   # NEXT_STEP: the next call resets these
        self._recorder_closed = False

    @property
    def _per_env(self) -> _PerEnvSink:
        """The sink of the modes that write some sub-envs' rows only (all but NEXT_STEP)."""
        assert isinstance(self._sink, _PerEnvSink), "NEXT_STEP writes whole batches only"
        return self._sink

    def reset(self, *, seed=None, options=None):
        mask = None
        if options is not None and "reset_mask" in options:
            mask = np.array(options["reset_mask"], np.bool_)
            options = dict(options)  # vector envs pop the key; leave the caller's dict whole
            if self._mode == AutoresetMode.NEXT_STEP and not mask.all():
                raise ValueError("RecordVectorEpisodes: reset_mask resets some sub-envs only; "
                                 "that is for autoreset_mode=DISABLED (this env is NEXT_STEP)")
        obs, info = self.env.reset(seed=seed, options=options)
        if mask is None or mask.all():
            for i in np.flatnonzero(self._open).tolist():
                self._sink.cut(i)
            self._sink.add_all(self._rows.first_batch(obs, self._n))
            self._open[:] = True
            self._stepped[:] = False
            self._ended[:] = False
        else:
            cols = {leaf.name: np.asarray(leaf.pick(obs)) for leaf in self._rows.obs}
            for i in np.flatnonzero(mask).tolist():
                if self._open[i]:
                    self._sink.cut(i)
                self._per_env.add(i, self._rows.first_of(_one(cols, i)))
            self._open[mask] = True
            self._stepped[mask] = False
        return obs, info

    def step(self, actions):
        waiting = ~(self._open | self._ended)
        if waiting.any():
            raise ResetNeeded(
                f"RecordVectorEpisodes: sub-envs {np.flatnonzero(waiting).tolist()} have no "
                "open episode; call reset() (in DISABLED mode with options={'reset_mask': "
                "mask} for the ended ones) before step()")
        obs, rewards, terminations, truncations, info = self.env.step(actions)
        term = np.asarray(terminations, np.bool_)
        trunc = np.asarray(truncations, np.bool_)
        if self._mode == AutoresetMode.NEXT_STEP:
            first = self._ended.copy()
            self._sink.add_all(self._rows.step_batch(obs, actions, rewards, term, first))
            ended = (term | trunc) & ~first
            self._ended = ended
            self._open = ~ended
            self._stepped = ~first   # a first env's row is its reset row
        else:
            no_first = np.zeros(self._n, np.bool_)
            cols = self._rows.step_batch(obs, actions, rewards, term, no_first)
            ended = term | trunc
            self._stepped[:] = True
            if self._mode == AutoresetMode.SAME_STEP:
                self._same_step(cols, ended, info)
            else:
                self._sink.add_all(cols)
                self._open &= ~ended
        for i in np.flatnonzero(ended & ~term).tolist():
            self._sink.cut(i)
        if self._mode == AutoresetMode.SAME_STEP:
            self._start(np.flatnonzero(ended), obs)
        return obs, rewards, terminations, truncations, info

    def _same_step(self, cols: dict, ended: np.ndarray, info: dict) -> None:
        """Write each sub-env's row; an ended one gets its final observation."""
        final = info.get("final_obs") if ended.any() else None
        if ended.any() and final is None:
            raise ValueError("RecordVectorEpisodes: a SAME_STEP sub-env ended but info has no "
                             "'final_obs'; record closer to the vector env")
        for i in range(self._n):
            row = _one(cols, i)
            if ended[i]:
                row = self._rows.replace_obs(row, final[i])  # type: ignore[index]  # checked above
            self._per_env.add(i, row)

    def _start(self, envs, obs) -> None:
        """SAME_STEP: the observation returned for an ended sub-env begins its next episode."""
        if len(envs):
            cols = {leaf.name: np.asarray(leaf.pick(obs)) for leaf in self._rows.obs}
            for i in envs.tolist():
                self._per_env.add(i, self._rows.first_of(_one(cols, i)))
            self._stepped[envs] = False
    def close(self, **kwargs):
        """Cut the open episodes and close the writers (never the buffer), then the env.

        As ``RecordEpisodes.close``: a sub-env whose episode is only its reset
        row is not cut (no 0-step episode is indexed).
        """
        if not self._recorder_closed:
            self._recorder_closed = True
            with contextlib.suppress(BufferClosedError, WritersStoppedError):
                for i in np.flatnonzero(self._open & self._stepped).tolist():
                    self._sink.cut(i)
            self._open[:] = False
            self._sink.close()
        return super().close(**kwargs)
