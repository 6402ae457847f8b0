"""Buffers with known contents for the selector tests, and the draw that children run.

``fill`` writes interleaved streams whose every step records where it is
(``x``: its global add number, which is also its place in the publish
order; ``ep``: its episode; ``o``: its offset in the episode), and returns
what the tests need to compute each selector's distribution exactly.
"""
import dataclasses

import numpy as np

SPEC = {"x": ((), np.int64), "ep": ((), np.int64), "o": ((), np.int64), "done": ((), np.bool_)}


@dataclasses.dataclass
class Contents:
    x: np.ndarray          # per step, in add order
    ep: np.ndarray
    o: np.ndarray
    ep_len: np.ndarray     # per episode id
    ep_end: np.ndarray     # x of each episode's last step (its place in the end order)

    def valid_starts(self, length: int) -> np.ndarray:
        """x of every start of a window of ``length`` steps that lies in its episode."""
        return self.x[self.ep_len[self.ep] - self.o >= length]


def fill(buf, lengths=(7, 30, 12, 45, 9, 22, 60, 15, 33, 5), streams: int = 2,
         rounds: int = 3) -> Contents:
    """Write ``streams`` interleaved streams (one Writer each, adds alternating), each a
    sequence of finished episodes with ``lengths`` (rotated per stream), ``rounds`` times."""
    writers = [buf.writer() for _ in range(streams)]
    plans = [[lengths[(i + s) % len(lengths)] for i in range(len(lengths) * rounds)]
             for s in range(streams)]
    pos = [[0, 0] for _ in range(streams)]           # (episode index in plan, offset)
    ep_ids = [[] for _ in range(streams)]
    ep_len, ep_end, xs, eps, os_ = [], [], [], [], []
    x = 0
    live = list(range(streams))
    while live:
        for s in list(live):
            i, o = pos[s]
            if o == 0:
                ep_ids[s].append(len(ep_len))
                ep_len.append(plans[s][i])
                ep_end.append(-1)
            e = ep_ids[s][-1]
            done = o == plans[s][i] - 1
            writers[s].add(x=x, ep=e, o=o, done=done)
            xs.append(x), eps.append(e), os_.append(o)
            if done:
                ep_end[e] = x
                pos[s] = [i + 1, 0]
                if i + 1 == len(plans[s]):
                    live.remove(s)
            else:
                pos[s] = [i, o + 1]
            x += 1
    for w in writers:
        w.close()
    return Contents(np.array(xs), np.array(eps), np.array(os_), np.array(ep_len),
                    np.array(ep_end))


def draw_starts(buf, select, seed: int, batches: int, batch_size: int,
                length: int) -> np.ndarray:
    """The first step's ``x`` of every window of ``batches`` batches (a child's job)."""
    rng = np.random.default_rng(seed)
    out = [buf.sample_sequences(batch_size, length, rng=rng, select=select)["x"][0]
           for _ in range(batches)]
    return np.concatenate(out)
