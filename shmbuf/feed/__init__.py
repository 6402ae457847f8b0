"""The trainer's feed: the torch DataLoader dataset, the prefetch iterator and the
hand-off of DataLoader batches through reused shared memory.  Imports torch."""
