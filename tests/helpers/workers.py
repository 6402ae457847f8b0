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


# -- additions for test_sampling.py and test_multiprocess.py -----------------------
#
# A vectorised env writes one stream per env row; each row is encoded exactly like
# a solo writer's step with the row's stream id in the ``writer`` field, so
# ``verify_window`` checks batch streams unchanged.


def batch_step(ids, pos, episode, t, done) -> dict:
    """Columns of one ``add_batch`` call: row i is step ``pos[i]`` of stream ``ids[i]``."""
    rows = [step_for(int(w), int(p), int(e), int(s), bool(d))
            for w, p, e, s, d in zip(ids, pos, episode, t, done)]
    return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in SPEC}


class EnvCursor:
    """Position, episode and step-in-episode of ``n_envs`` streams ``first_id + env``.

    Env ``e`` has episodes of ``5 + 3 * e`` steps; env ``e`` with ``e % 3 == 1`` is
    also cut by ``end_episode`` (a time limit) every ``7 + e`` steps, so terminals and
    cuts never line up across envs.
    """

    def __init__(self, first_id: int, n_envs: int):
        self.ids = np.arange(first_id, first_id + n_envs)
        self.pos = np.zeros(n_envs, np.int64)
        self.episode = np.zeros(n_envs, np.int64)
        self.t = np.zeros(n_envs, np.int64)
        self.episode_len = 5 + 3 * np.arange(n_envs)

    def next_batch(self) -> dict:
        done = self.t == self.episode_len - 1
        batch = batch_step(self.ids, self.pos, self.episode, self.t, done)
        self.pos += 1
        self.t = np.where(done, 0, self.t + 1)
        self.episode += done
        return batch

    def cuts_due(self) -> list:
        """Envs to cut after the batch just written (never right after a terminal)."""
        env = np.arange(len(self.ids))
        due = (env % 3 == 1) & (self.pos % (7 + env) == 0) & (self.t != 0)
        return [int(e) for e in np.flatnonzero(due)]

    def cut(self, env: int) -> None:
        self.episode[env] += 1
        self.t[env] = 0


def write_batches(w, cursor: EnvCursor, n_calls: int) -> None:
    """``n_calls`` add_batch calls through ``w``, with the cursor's cuts."""
    for _ in range(n_calls):
        w.add_batch(**cursor.next_batch())
        for env in cursor.cuts_due():
            w.end_episode(env)
            cursor.cut(env)


def write_until(buf, writer_id: int, stop, ready, max_steps: int,
                episode_len: int = 37, ready_after: int = 100) -> int:
    """Worker body: add encoded steps until ``stop`` is set or ``max_steps`` are written.

    Releases ``ready`` (a semaphore) once, after ``ready_after`` steps.
    """
    written = 0
    with buf.writer() as w:
        for step in episode_steps(writer_id, max_steps, episode_len):
            w.add(**step)
            written += 1
            if written == ready_after:
                ready.release()
            if written % 32 == 0 and stop.is_set():
                break
    if written < ready_after:
        ready.release()
    return written


def write_batches_until(buf, first_id: int, n_envs: int, stop, ready, max_calls: int,
                        ready_after: int = 20) -> None:
    """Worker body: add_batch ``n_envs`` env streams until ``stop`` or ``max_calls``."""
    cursor = EnvCursor(first_id, n_envs)
    with buf.writer() as w:
        for call in range(1, max_calls + 1):
            write_batches(w, cursor, 1)
            if call == ready_after:
                ready.release()
            if call % 8 == 0 and stop.is_set():
                break
    if max_calls < ready_after:
        ready.release()


def add_with_inherited_writer(w, writer_id: int, n_steps: int, episode_len: int) -> None:
    """Forked-child body: keep using the parent's Writer object ``w``."""
    for step in episode_steps(writer_id, n_steps, episode_len):
        w.add(**step)
    w.close()


def extend_until(buf, writer_id: int, stop, ready, max_steps: int, episode_len: int = 37,
                 run: int = 29) -> int:
    """Worker body: ``Writer.extend`` runs of ``run`` encoded steps until ``stop``.

    Runs and episodes do not line up, so runs carry terminals at every offset
    and span chunk boundaries.  Releases ``ready`` once after the first run.
    """
    steps = episode_steps(writer_id, max_steps, episode_len)
    written = 0
    with buf.writer() as w:
        while written < max_steps:
            rows = [s for _, s in zip(range(run), steps)]
            if not rows:
                break
            w.extend(**{k: np.stack([np.asarray(r[k]) for r in rows]) for k in SPEC})
            if written == 0:
                ready.release()
            written += len(rows)
            if stop.is_set():
                break
    return written
