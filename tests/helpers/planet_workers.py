"""Encoded PlaNet episodes, the checks that decode them, and worker bodies.

Step ``s`` of episode ``k`` recorded by writer ``w`` (an episode of ``T``
steps has observations for s = 0..T, the last one the final observation):
  obs      (2, 3) float32: row 0 = (w, k, s), row 1 = a checksum of (w, k, s)
  action   (3,)   float32: (w, k, s + 0.5)
  reward   float32 w * 100000 + k * 1000 + s (exact in float32)
  terminal s == T - 1, and also s == 1 when k % 3 == 0 (a terminal flag
           inside an episode is data; only the episode's end cuts windows)
``check_batch`` recomputes all of it for every sampled sequence.  Kept out of
the test file so that spawned workers can import it.
"""
import numpy as np

from shmbuf.compat.planet import Episode

OBS_SHAPE = (2, 3)
ACTION_SIZE = 3


def episode_length(writer, k):
    return 4 + (5 * k + 3 * writer) % 9


# The encodings take ints or broadcastable int arrays (for checking whole batches).
def obs_value(writer, k, s) -> np.ndarray:
    w, k, s = np.broadcast_arrays(writer, k, s)
    check = ((w * 7 + k * 13 + s * 29) % 251, s * 2 + 1, w + k + 0.25)
    return np.stack([np.stack((w, k, s), -1), np.stack(check, -1)], -2).astype(np.float32)


def action_value(writer, k, s) -> np.ndarray:
    w, k, s = np.broadcast_arrays(writer, k, s)
    return np.stack((w, k, s + 0.5), -1).astype(np.float32)


def reward_value(writer, k, s):
    return np.float32(writer * 100000 + k * 1000 + s)


def terminal_value(k, s, length):
    return (s == length - 1) | ((s == 1) & (k % 3 == 0))


def halve(x):
    """A postprocess_fn (module level, so that spawned workers can use it)."""
    return x / 2


def record(writer: int, k: int, length: int | None = None, torch_inputs: bool = False,
           doubled: bool = False) -> Episode:
    """Episode ``k`` of ``writer``, terminated; ``doubled`` records 2x obs and halves them."""
    length = episode_length(writer, k) if length is None else length
    ep = Episode(postprocess_fn=halve if doubled else None)
    scale = 2 if doubled else 1

    def obs(s):
        value = obs_value(writer, k, s) * scale
        if torch_inputs:
            import torch

            return torch.from_numpy(value)
        return value

    for s in range(length):
        act = action_value(writer, k, s)
        if torch_inputs:
            import torch

            act = torch.from_numpy(act)
        ep.append(obs(s), act, float(reward_value(writer, k, s)),
                  bool(terminal_value(k, s, length)))
    ep.terminate(obs(length))
    return ep


def check_batch(sequences, lengths, tracelen: int, time_first: bool = False,
                length_of=episode_length) -> list:
    """Assert every sampled sequence is intact; return its (writer, episode, start)."""
    x, u, r, t = sequences
    batch = len(lengths)
    lead = (tracelen, batch) if time_first else (batch, tracelen)
    assert x.shape == (lead[0] + time_first, lead[1] + (not time_first)) + OBS_SHAPE, x.shape
    assert u.shape == lead + (ACTION_SIZE,) and r.shape == t.shape == lead, (u.shape, r.shape)
    if time_first:
        x, u, r, t = (np.swapaxes(a, 0, 1) for a in (x, u, r, t))
    writer, k, start = (x[:, 0, 0, i].astype(np.int64) for i in range(3))
    np.testing.assert_array_equal(lengths, length_of(writer, k), "lengths is not T")
    assert (start >= 0).all() and (start + tracelen <= lengths).all(), "window runs past the end"
    w, k_, steps = writer[:, None], k[:, None], start[:, None] + np.arange(tracelen + 1)
    np.testing.assert_array_equal(x, obs_value(w, k_, steps), "observations")
    steps = steps[:, :-1]
    np.testing.assert_array_equal(u, action_value(w, k_, steps), "actions")
    np.testing.assert_array_equal(r, reward_value(w, k_, steps), "rewards")
    np.testing.assert_array_equal(t, terminal_value(k_, steps, lengths[:, None]), "terminals")
    return list(zip(writer.tolist(), k.tolist(), start.tolist()))


def append_episodes(memory, writer: int, n_episodes: int, ready=None) -> int:
    """Worker body: record episodes and append them, one or two per call.

    Odd writers record through a postprocess_fn; ``ready`` (a semaphore) is
    released once, after the first append.
    """
    try:
        k = 0
        while k < n_episodes:
            batch = [record(writer, k, doubled=writer % 2 == 1)]
            if k % 4 == 3 and k + 1 < n_episodes:
                batch.append(record(writer, k + 1))
            memory.append(batch)
            if k == 0 and ready is not None:
                ready.release()
            k += len(batch)
        return k
    finally:
        memory.close()
