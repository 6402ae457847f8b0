"""What the Dreamer and IRIS facade tests share: encoded streams and a spawned writer.

Kept out of test files so that spawned children can import it.
"""
import multiprocessing as mp

from helpers.procs import join_all, running
from helpers.workers import step_for
from shmbuf.compat.dreamer import ReplayBuffer

JOIN_S = 60.0


def add_step(rb, step: dict) -> None:
    """Add one encoded step through the facade's own ``add`` signature."""
    if isinstance(rb, ReplayBuffer):   # Dreamer takes {"image": frame} and a float done
        rb.add({"image": step["obs"]}, step["action"], step["reward"], float(step["done"]))
    else:
        rb.add(step["obs"], step["action"], step["reward"], step["done"])


class Stream:
    """One writer's encoded steps, continued across calls: (writer, pos, episode, done)."""

    def __init__(self, writer: int):
        self.writer, self.pos, self.episode, self.t = writer, 0, 0, 0
        self.steps = []

    def add(self, rb, n: int, end: bool = False) -> "Stream":
        """Add ``n`` steps; the last one ends the episode if ``end``."""
        for i in range(n):
            done = end and i == n - 1
            add_step(rb, step_for(self.writer, self.pos, self.episode, self.t, done))
            self.steps.append((self.writer, self.pos, self.episode, done))
            self.pos += 1
            self.episode, self.t = (self.episode + 1, 0) if done else (self.episode, self.t + 1)
        return self

    def episodes(self, rb, lengths, tail: int = 0) -> "Stream":
        """Add whole episodes of ``lengths`` steps, then ``tail`` steps of an open one."""
        for n in lengths:
            self.add(rb, n, end=True)
        return self.add(rb, tail)


def writer_proc(rb, writer: int, n_steps: int, episode_len: int, tail: int, conn):
    """Child: add encoded steps, saying "ready" after 100 of them and "paused" before the
    last ``tail``, which wait for the trainer's "go"."""
    try:
        for pos in range(n_steps):
            if pos == 100:
                conn.send("ready")
            if pos == n_steps - tail:
                conn.send("paused")
                if not conn.poll(JOIN_S):
                    raise TimeoutError("the trainer never said go")
                conn.recv()
            episode, t = divmod(pos, episode_len)
            add_step(rb, step_for(writer, pos, episode, t, t == episode_len - 1))
    finally:
        rb.close()
        conn.close()


def expect(conn, word: str) -> None:
    """The child's next message is ``word`` (within JOIN_S); pipes, not named semaphores,
    so nothing appears in /dev/shm."""
    assert conn.poll(JOIN_S), f"a writer never said {word!r}"
    got = conn.recv()
    assert got == word, got


def run_writers(rb, lengths: dict, n_steps: int, tail: int, while_writing, while_finishing):
    """Spawn one ``writer_proc`` per ``{writer: episode_len}`` and sample meanwhile.

    ``while_writing()`` runs (up to 80 times) until every writer paused before
    its last ``tail`` steps, ``while_finishing()`` (up to 80 more) while they
    add those; then every writer is joined and must have exited with 0.
    """
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        with running(procs, JOIN_S):
            for writer, n in lengths.items():
                mine, theirs = ctx.Pipe()
                conns.append(mine)
                procs.append(ctx.Process(target=writer_proc,
                                         args=(rb, writer, n_steps, n, tail, theirs), daemon=True))
                procs[-1].start()
                theirs.close()
            for conn in conns:
                expect(conn, "ready")
            waiting, batches = list(conns), 0
            while waiting and batches < 80:   # sample while they write
                while_writing()
                batches += 1
                for conn in [c for c in waiting if c.poll(0)]:
                    expect(conn, "paused")
                    waiting.remove(conn)
            for conn in waiting:
                expect(conn, "paused")
            for conn in conns:
                conn.send("go")
            while any(p.is_alive() for p in procs) and batches < 160:
                while_finishing()
                batches += 1
            join_all(procs, JOIN_S)
    finally:
        for conn in conns:
            conn.close()


def report_from_child(conn, work) -> None:
    """Child: send ``work()``'s message, then ("done",); on failure ("error", reason)."""
    try:
        conn.send(work())
        conn.send(("done",))
    except BaseException as exc:   # report, so the parent fails with the reason
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


def run_attacher(target, name: str) -> tuple:
    """Spawn ``target(name, conn)`` (built on ``report_from_child``) and return its
    message once it said ("done",) and exited with 0; killed and reaped on failure."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(name, theirs), daemon=True)
    try:
        with running([proc], JOIN_S):
            theirs.close()
            assert mine.poll(JOIN_S), "the child never reported"
            first = mine.recv()
            assert first[0] == "params", first
            assert mine.poll(JOIN_S) and mine.recv() == ("done",)
            join_all([proc], JOIN_S)
    finally:
        mine.close()
    return first
