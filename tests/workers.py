"""Worker entry points and the step encoding that tests verify windows with.

Every step a test writer adds encodes where it came from:
  action = [writer, episode, step in episode, position in stream, checksum, 0]
  obs    = a pattern derived from (writer, position); reward = position.
``verify_window`` recomputes all of it, so a torn, duplicated, misplaced or
spliced step cannot go unnoticed.  Kept out of test files so that spawned
children can import it.
"""
import numpy as np

SPEC = {
    "obs": ((3, 8, 8), np.uint8),
    "action": ((6,), np.float32),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}
_PATTERN = np.arange(3 * 8 * 8, dtype=np.int64).reshape(3, 8, 8)


def obs_for(writer: int, pos: int) -> np.ndarray:
    return ((_PATTERN * 7 + writer * 131 + pos * 17) % 251).astype(np.uint8)


def step_for(writer: int, pos: int, episode: int, t: int, done: bool) -> dict:
    obs = obs_for(writer, pos)
    checksum = float(int(obs.sum()) % 65521)
    action = np.array([writer, episode, t, pos, checksum, 0], np.float32)
    return {"obs": obs, "action": action, "reward": np.float32(pos), "done": done}


def episode_steps(writer: int, n_steps: int, episode_len: int):
    """Yield the encoded steps of one writer's stream: fixed-length episodes."""
    for pos in range(n_steps):
        episode, t = divmod(pos, episode_len)
        yield step_for(writer, pos, episode, t, t == episode_len - 1)


def verify_window(obs, action, reward, done) -> None:
    """Assert one (L, ...) window is intact: one stream, one episode, contiguous."""
    writer, episode, t, pos, checksum = (action[:, i] for i in range(5))
    length = len(reward)
    assert (writer == writer[0]).all(), f"window mixes writers {set(writer.tolist())}"
    assert (episode == episode[0]).all(), f"window crosses episodes {episode.tolist()}"
    assert (np.diff(pos) == 1).all(), f"positions not contiguous: {pos.tolist()}"
    assert (np.diff(t) == 1).all(), f"episode steps not contiguous: {t.tolist()}"
    assert (reward == pos).all(), "reward does not match the position in the stream"
    assert not done[:-1].any(), "window continues past a terminal step"
    for i in range(length):
        expect = obs_for(int(writer[i]), int(pos[i]))
        assert (obs[i] == expect).all(), f"torn observation at window row {i}"
        assert float(int(expect.sum()) % 65521) == checksum[i], "checksum mismatch"


def verify_batch(batch: dict, time_major: bool = True) -> int:
    """Verify every window of a sampled batch; return how many were checked."""
    arrays = {k: (np.swapaxes(v, 0, 1) if time_major else v) for k, v in batch.items()}
    n = len(arrays["reward"])
    for b in range(n):
        verify_window(arrays["obs"][b], arrays["action"][b], arrays["reward"][b],
                      arrays["done"][b])
    return n


def write_steps(buf, writer_id: int, n_steps: int, episode_len: int = 37) -> int:
    """Worker body: add ``n_steps`` encoded steps through one writer."""
    with buf.writer() as w:
        for step in episode_steps(writer_id, n_steps, episode_len):
            w.add(**step)
    return n_steps
