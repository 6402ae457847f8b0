"""Spawned-process bodies for tests/test_compat_torchrl.py (importable by the children).

Every row a writer makes encodes ``(writer, step, check)`` with
``check = writer * 1_000_003 + step``, so a reader can tell a torn, mixed or
misplaced step.
"""
import torch
from tensordict import TensorDict


def check_of(writer, step):
    return writer * 1_000_003 + step


def rows(writer: int, first: int, n: int, traj_len: int = 0) -> TensorDict:
    """``n`` steps of writer ``writer`` from step ``first``; trajectories of ``traj_len``
    steps (0: one trajectory per writer)."""
    step = torch.arange(first, first + n)
    traj = step // traj_len if traj_len else torch.zeros(n, dtype=torch.int64)
    return TensorDict({
        "obs": torch.stack([torch.full((n,), writer), step, check_of(writer, step)], -1),
        "pixels": (step % 251).to(torch.uint8)[:, None, None].expand(n, 4, 4).clone(),
        ("collector", "traj_ids"): traj + 1000 * writer,
    }, [n])


def extend_loop(rb, writer: int, batches: int, batch: int, traj_len: int, ready, go):
    """Extend ``batches`` batches of encoded rows, after ``go`` is set."""
    ready.put(writer)
    go.wait(60)
    for b in range(batches):
        rb.extend(rows(writer, b * batch, batch, traj_len))


def extend_forever(rb, writer: int, batch: int, ready):
    """Extend encoded rows until killed (the crash test SIGKILLs it)."""
    b = 0
    while True:
        rb.extend(rows(writer, b * batch, batch))
        if b == 3:
            ready.put(writer)
        b += 1


def write_first(rb, out):
    """A child that writes the storage's first batch; reports the indices."""
    index = rb.extend(rows(7, 0, 5))
    out.put(index.tolist())


def read_rows(storage, index, out):
    """Read ``storage[index]`` in this process; report the obs."""
    out.put(storage[torch.tensor(index)]["obs"].tolist())


def bump_priority(rb, index, out):
    """Set a large priority on the steps at ``index``, from this process."""
    rb.update_priority(torch.tensor(index), torch.full((len(index),), 1000.0))
    out.put("done")


def write_first_forked(rb, out):
    """A forked child (it inherited the storage, unpickled nothing) writes the first batch."""
    storage = rb.storage
    index = rb.extend(rows(8, 0, 4))
    out.put((storage.owner, index.tolist()))
    del rb, storage
    import gc
    gc.collect()   # a child that drops its handles must not remove the parent's data


def picture_rows(writer: int, first: int, n: int) -> TensorDict:
    """``rows`` with a large picture (64x64, one value a step) under a nested key too: a
    chunk of a few steps spans whole pages, which a compressing storage gives back."""
    data = rows(writer, first, n)
    step = torch.arange(first, first + n)
    data["next", "pixels"] = (step % 239).to(torch.uint8)[:, None, None].expand(
        n, 64, 64).clone()
    return data


def read_index(storage, index, out):
    """Report ``storage[index]`` (obs, pixels, nested pixels) and ``storage[:]``'s, read
    in this process."""
    parts = []
    for got in (storage[index], storage[:]):
        parts.append([got[key].tolist() for key in ("obs", "pixels", ("next", "pixels"))])
    out.put(parts)


def serve(rb, commands, replies):
    """Run the parent's commands on ``rb`` in this process, one at a time, until "stop":
    ("extend", writer, first, n) -> the indices, ("len",) -> len(rb),
    ("read",) -> rb[:]["obs"], ("sample",) -> a sample's obs, or the error's class name."""
    while True:
        command = commands.get(timeout=60)
        if command[0] == "stop":
            return
        try:
            if command[0] == "extend":
                replies.put(rb.extend(rows(*command[1:])).tolist())
            elif command[0] == "len":
                replies.put(len(rb))
            elif command[0] == "read":
                replies.put(rb[:]["obs"].tolist())
            elif command[0] == "sample":
                replies.put(rb.sample()["obs"].tolist())
        except Exception as exc:   # reported to the parent, which asserts on it
            replies.put(type(exc).__name__)


def extend_until(rb, writer: int, batch: int, done, stop):
    """Extend batch after batch (batch ``b`` holds steps ``b * batch`` on), reporting each
    number on ``done``, until ``stop`` is set; then one more, reported as ("last", b)."""
    b = 0
    while not stop.is_set():
        rb.extend(rows(writer, b * batch, batch))
        done.put(b)
        b += 1
    rb.extend(rows(writer, b * batch, batch))
    done.put(("last", b))
