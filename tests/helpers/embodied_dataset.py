"""A torch dataset over a Replay, for DataLoader workers (apart: spawned actors skip torch)."""
from torch.utils.data import IterableDataset


class Batches(IterableDataset):
    """``batches`` batches of ``replay.sample(4)``'s steps, for a torch DataLoader."""

    def __init__(self, replay, batches: int):
        self.replay, self.batches = replay, batches

    def __iter__(self):
        for _ in range(self.batches):
            yield self.replay.sample(4)["step"]
