"""The actor loop: one env (or vector env), a copy of the policy, a recorder, in one process."""
from __future__ import annotations

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from .._errors import WritersStoppedError
from ._recorders import RecordEpisodes, RecordVectorEpisodes, autoreset_mode


def run_actor(make_env, buffer, act, *, params=None, steps: int | None = None, stop=None,
              seed: int | None = None, wait_params: float | None = 60.0) -> dict:
    """Play ``make_env()`` with ``act`` and record every step into ``buffer``; return counts.

    Call it in each actor process (the target of a ``multiprocessing``
    process): the env steps here and its steps go straight into shared
    memory.  Policy weights come from ``params`` (a ``shmbuf.params.ParamBlock``
    the trainer publishes to): the loop waits for the first version, then
    checks the version before every step (two atomic loads) and reads the
    newest weights when it changed.  The loop ends after ``steps``, when
    ``stop`` is set, or when the trainer calls ``buffer.stop_writers()``
    (also while the step waits for the rate limit): the usual way to end
    actors, since a rate-limited actor may be waiting in ``add`` for samples
    that will not come.

    Args:
        make_env: ``() -> gymnasium.Env`` or ``VectorEnv``, built in this process.
        buffer: a ``shmbuf.Buffer`` made with ``spec_for`` (pickled: attached).
        act: ``act(obs, weights) -> action``; ``weights`` is the newest
            ``{name: array}`` of ``params`` (None without ``params``).  For a
            vector env ``obs`` and the action are batched.
        params: optional ``ParamBlock``.
        steps: stop after this many ``step`` calls (None: no limit).
        stop: optional event (anything with ``is_set()``) that ends the loop
            before the next step.
        seed: seed of the first reset.
        wait_params: seconds to wait for the first published version.

    Returns:
        ``{"steps": step calls, "episodes": episodes ended, "version": the
        newest weights' version used, "refreshes": weight reads, "stopped":
        whether ``stop_writers`` ended it}``.  A step that the stop
        interrupted is not counted (its row was not written).

    Raises:
        WaitTimeoutError: no weights were published within ``wait_params`` seconds.

    Example:
        >>> procs = [ctx.Process(target=run_actor, args=(make_env, buf, act),
        ...                      kwargs={"params": block, "stop": stop}) for _ in range(4)]
    """
    env = make_env()
    vector = isinstance(env, VectorEnv)
    env = RecordVectorEpisodes(env, buffer) if vector else RecordEpisodes(env, buffer)
    disabled = vector and autoreset_mode(env) == AutoresetMode.DISABLED
    version, weights, refreshes, episodes, done_steps, stopped = 0, None, 0, 0, 0, False
    try:
        if params is not None:
            params.wait_version(1, wait_params)
        obs, _ = env.reset(seed=seed)
        while (steps is None or done_steps < steps) and not (stop is not None and stop.is_set()):
            if params is not None:
                got = params.read_newer(version)
                if got is not None:
                    (version, weights), refreshes = got, refreshes + 1
            obs, _, terminated, truncated, _ = env.step(act(obs, weights))
            done_steps += 1
            ended = np.logical_or(terminated, truncated)
            if vector:
                episodes += int(np.count_nonzero(ended))
                if disabled and ended.any():
                    obs, _ = env.reset(options={"reset_mask": ended})
            elif ended:
                episodes += 1
                obs, _ = env.reset()
    except WritersStoppedError:
        stopped = True   # the trainer stopped the buffer's writers: this actor is done
    finally:
        env.close()
    return {"steps": done_steps, "episodes": episodes, "version": version,
            "refreshes": refreshes, "stopped": stopped}
