"""Encoded DIAMOND steps, their checks, and the body that spawned writers run.

Step ``t`` of episode ``e`` of writer ``w``, at position ``pos`` of its stream:
  obs      = frame(w, e, t)              next_obs = frame(w, e, t + 1)
  action   = [w + .25, e + .5, t + .125, pos + .375]   (fractions: continuous actions)
  reward   = pos
  done     = t is the episode's last step, except for "cut" writers (w >= CUT_FROM),
             whose episodes end with end_episode() instead of a terminal step.
``frame(w, e, episode_len(w))``, a terminal step's next_obs, is never anyone's
obs, so a next_obs derived from the next row would be caught.  Every sampled
element is checked against what that step must hold.  Kept out of the test
file so that spawned children import no torch and no pytest.
"""
import numpy as np

H, W, C, A = 4, 6, 3, 4
OBS_SHAPE = (H, W, C)
FRACTIONS = np.array([0.25, 0.5, 0.125, 0.375], np.float32)
CUT_FROM = 10
_PATTERN = np.arange(H * W * C, dtype=np.int64).reshape(H, W, C)


def episode_len(writer: int) -> int:
    return 5 + 2 * (writer % CUT_FROM)


def frame(writer, episode, t) -> np.ndarray:
    """The ``(..., H, W, C)`` frame(s) of step ``t`` of ``episode`` (ints or arrays of ids)."""
    w, e, t = np.broadcast_arrays(writer, episode, t)
    f = (_PATTERN * 5 + (31 * w + 17 * e + 7 * t)[..., None, None, None]) % 251
    f[..., 0, 0, :] = np.stack([w, e % 256, t % 256], axis=-1)
    return f.astype(np.uint8)


def step(writer: int, pos: int, length: int | None = None) -> tuple:
    """``(obs, action, reward, done, next_obs)`` of step ``pos`` of ``writer``'s stream."""
    length = length or episode_len(writer)
    e, t = divmod(pos, length)
    action = np.array([writer, e, t, pos], np.float32) + FRACTIONS
    done = t == length - 1 and writer < CUT_FROM
    return frame(writer, e, t), action, float(pos), done, frame(writer, e, t + 1)


def add_steps(rb, writer: int, n_steps: int, first_pos: int = 0, length: int | None = None):
    """Add positions ``first_pos ..`` of ``writer``'s stream through ``rb``; return the next."""
    length = length or episode_len(writer)
    for pos in range(first_pos, first_pos + n_steps):
        rb.add(*step(writer, pos, length))
        if writer >= CUT_FROM and pos % length == length - 1:
            rb.end_episode()
    return first_pos + n_steps


def write_worker(rb, writer: int, n_steps: int, ready, go) -> None:
    """Spawned writer: half the steps, ``ready.release()``, wait for ``go``, the rest."""
    try:
        for pos in range(n_steps):
            if pos == n_steps // 2:
                ready.release()
                assert go.wait(timeout=60), "the trainer never said go"
            rb.add(*step(writer, pos))
    finally:
        rb.close()


# -- checks ---------------------------------------------------------------------


def to_frames(x) -> np.ndarray:
    """float32 ``(..., C, H, W)`` in [0, 1] back to the uint8 ``(..., H, W, C)`` it came from."""
    import torch

    assert x.dtype == torch.float32 and x.is_contiguous()
    assert x.shape[-3:] == (C, H, W), f"frames are not CHW: {tuple(x.shape)}"
    values = x.numpy()
    back = np.rint(values * 255).astype(np.uint8)
    assert (np.divide(back, 255, dtype=np.float32) == values).all(), "not exactly uint8 / 255"
    return np.moveaxis(back, -3, -1)


def _lengths(writer, length: int | None):
    return np.full(writer.shape, length) if length else 5 + 2 * (writer % CUT_FROM)


def identities(actions, length: int | None = None) -> np.ndarray:
    """``(..., 4)`` int (writer, episode, t, pos) read from encoded actions, checked."""
    a = actions.numpy()
    ident = np.floor(a).astype(np.int64)
    assert (a - ident == FRACTIONS).all(), "continuous action fractions were lost"
    w, e, t, pos = np.moveaxis(ident, -1, 0)
    assert (pos == e * _lengths(w, length) + t).all(), "action fields disagree"
    return ident


def check_steps(ident, obs, next_obs, rewards, dones, length: int | None = None) -> None:
    """Every element of a batch (any leading dims) is the step its action names."""
    w, e, t, pos = np.moveaxis(ident, -1, 0)
    assert (to_frames(obs) == frame(w, e, t)).all(), "an obs is not its step's frame"
    assert (to_frames(next_obs) == frame(w, e, t + 1)).all(), "a next_obs is not the next frame"
    assert (rewards.numpy() == pos).all()
    terminal = (t == _lengths(w, length) - 1) & (w < CUT_FROM)
    assert (dones.numpy() == terminal).all(), "dones are not the steps' terminal flags"


def check_windows(ident) -> None:
    """``(B, T, 4)`` windows: one writer, one episode, consecutive steps."""
    w, e, t, pos = np.moveaxis(ident, -1, 0)
    assert (w == w[:, :1]).all(), "a window mixes writer streams"
    assert (e == e[:, :1]).all(), "a window crosses an episode boundary"
    assert (np.diff(t, axis=1) == 1).all() and (np.diff(pos, axis=1) == 1).all(), \
        "a window is not consecutive steps (spliced at the wrap point?)"


def check_sequences(seq, length: int | None = None) -> np.ndarray:
    """A ``sample_sequence`` batch, burn-in included; return its (B, burn_in + L, 4) ids."""
    ident = identities(seq["actions"], length)
    context = identities(seq["burn_in_actions"], length)
    check_steps(ident, seq["obs"], seq["next_obs"], seq["rewards"], seq["dones"], length)
    full = np.concatenate([context, ident], axis=1)
    check_windows(full)
    w, e, t, _ = np.moveaxis(context, -1, 0)
    assert (to_frames(seq["burn_in_obs"]) == frame(w, e, t)).all(), "a burn-in obs is wrong"
    return full


def check_items(batch, length: int | None = None) -> np.ndarray:
    """A collated ``SequenceDataset`` batch; return its (B, burn_in + L, 4) ids."""
    assert (batch["actions"] == batch["action_seq"]).all(), "actions is not action_seq"
    seq = {"obs": batch["obs_seq"], "actions": batch["action_seq"], "rewards": batch["rewards"],
           "dones": batch["dones"], "burn_in_obs": batch["burn_in_obs"],
           "burn_in_actions": batch["burn_in_actions"]}
    ident = identities(seq["actions"], length)
    w, e, t, _ = np.moveaxis(ident[:, -1], -1, 0)
    assert (to_frames(batch["next_obs"]) == frame(w, e, t + 1)).all(), \
        "next_obs is not the frame right after obs_seq"
    seq["next_obs"] = _shifted(batch["obs_seq"], batch["next_obs"])
    return check_sequences(seq, length)


def _shifted(obs_seq, next_obs):
    """Per-step next frames of item windows: obs_seq[1:] then the item's next_obs."""
    import torch

    return torch.cat([obs_seq[:, 1:], next_obs[:, None]], dim=1).contiguous()
