"""gymnasium glue: buffer specs from spaces, and recorders that write episodes as they run.

Install with ``pip install -e '.[gym]'``; the core (``import shmbuf``) never
imports gymnasium.

The step convention
-------------------
One row per observation.  A row holds the observation, the action that led
to it, the reward received on arriving there, and two flags::

    env     reset -> o0   step(a0) -> o1, r1   step(a1) -> o2, r2   ...   step(a_T-1) -> oT, rT
    row     0             1                    2                          T
    obs     o0            o1                   o2                         oT  (final observation)
    action  0 (blank)     a0                   a1                         a_T-1
    reward  0             r1                   r2                         rT
    is_first  True        False                False                      False
    done    False         False                False                      terminated

- An episode of T env steps is T + 1 rows: its length in env steps is
  ``rows - 1`` and its return is ``reward.sum()``.
- The first row's action is a blank (zeros) and its reward is 0: there was
  no step before it.  Models mask what came "before" a row with
  ``is_first`` (Dreamer's RSSM resets its state and zeroes the action there).
- ``done`` is ``terminated`` only: the episode really ended, and there is
  nothing to bootstrap from.  A truncation (a time limit, an early
  ``reset()``, ``close()``) stores the final observation with
  ``done=False`` and cuts the episode (``Writer.end_episode``): no sampled
  window spans it, and ``Buffer.episodes()`` lists it as not terminal.
- A window ``sample_sequences(B, L)`` lies within one episode, so
  ``is_first`` can only be true on its first row and ``done`` only on its
  last.  For a dynamics model, ``(obs[t], action[t+1]) -> (obs[t+1],
  reward[t+1], done[t+1])``; for an RSSM, step ``t`` consumes
  ``action[t]`` then ``obs[t]``.

Why this one: it is Dreamer's (V1/V2) and PlaNet's, the layout those world
models consume.  Every row is complete the moment ``env.step`` returns, so a
recorder writes it at once and holds nothing back: no pending row to lose
when an actor dies, no dummy action on the final observation, and each row
is exactly what one ``step`` call consumed and returned, so an observation
cannot be paired with another step's action.  (DreamerV3's replay stores the
action taken *from* the row's observation instead; that needs each row held
back until the policy acts, and a dummy action on every final observation.)
"""
from __future__ import annotations

from ._actor import run_actor
from ._recorders import RecordEpisodes, RecordVectorEpisodes, autoreset_mode
from ._spaces import CONVENTION, UnsupportedSpaceError
from ._spaces import spec as _spec


def spec_for(env, **overrides) -> dict:
    """The buffer spec for ``env``'s spaces under the step convention above.

    Columns: one per observation leaf (``obs``, or ``obs_<key>`` for each
    key of a ``Dict`` and ``obs_<i>`` of a ``Tuple``, nested keys joined by
    ``_``), the same for actions (``action...``), then ``reward`` (float32),
    ``is_first`` and ``done`` (bool).  Each leaf gets the smallest dtype that
    holds its space exactly: ``Discrete(2)`` is ``uint8``, ``MultiBinary``
    is ``bool``, an integer ``Box`` shrinks to its bounds, float and bool
    ``Box`` keep their dtype (an image ``Box(0, 255, uint8)`` stays ``uint8``).

    Args:
        env: a ``gymnasium.Env`` or ``gymnasium.vector.VectorEnv`` (its
            single-env spaces are used).
        **overrides: ``column=(shape, dtype)`` replaces a column; e.g.
            ``reward=((), "float64")``, or ``obs_text=((), "U64")`` for a
            ``Text`` space.  Values written there must fit losslessly.

    Returns:
        ``{column: (shape, dtype)}`` for ``shmbuf.create``.

    Raises:
        UnsupportedSpaceError: a ``Text``, ``Graph``, ``Sequence`` or other
            space without a fixed shape and dtype and no override for it; the
            message names the column and suggests one (also a TypeError).
        KeyError: an override names no column.

    Example:
        >>> buf = shmbuf.create(spec_for(gym.make("CartPole-v1")), capacity=100_000)
        >>> buf.spec["action"]      # ((), dtype('uint8'))
    """
    obs_space = getattr(env, "single_observation_space", None)
    act_space = getattr(env, "single_action_space", None)
    if obs_space is None or act_space is None:  # a single env (Dict spaces may be falsy)
        obs_space, act_space = env.observation_space, env.action_space
    return _spec(obs_space, act_space, overrides)


__all__ = ["CONVENTION", "RecordEpisodes", "RecordVectorEpisodes", "UnsupportedSpaceError",
           "autoreset_mode", "run_actor", "spec_for"]
