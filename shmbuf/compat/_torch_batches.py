"""The seed facades' sample shapes as torch batches, for ``prefetch`` and ``dataset``.

Each function takes the core batch (``sample_sequences``' dict of tensors)
and returns what the facade's own sampler returns, as tensors on the
batch's device.  They are module functions so that a dataset pickles them
by name for spawned DataLoader workers.
"""
from __future__ import annotations


def dreamer(batch):
    """Dreamer ``sample()``: ``(obs, act, rew, term)``, time-major, ``term`` float32."""
    return batch["obs"], batch["action"], batch["reward"], batch["done"].float()


def iris(batch):
    """IRIS ``sample_sequence()`` from ``seq_len + 1`` batch-major rows (``tail=1``).

    ``obs`` keeps all ``seq_len + 1`` frames, the rest the first ``seq_len``
    steps; after a terminal last step the following frame was never stored,
    so the terminal frame is repeated, as the numpy sampler does.
    """
    obs, done = batch["obs"], batch["done"]
    length = done.shape[1] - 1
    ended = done[:, length - 1]
    obs[ended, length] = obs[ended, length - 1]
    return (obs, batch["action"][:, :length], batch["reward"][:, :length],
            done[:, :length].float())


def prefetch(facade, batch_size: int, length: int, shape, depth, device, pin_memory,
             **sample_kwargs):
    """``Buffer.prefetch`` of the facade's buffer, each batch passed through ``shape``."""
    facade._check_open()
    return facade.buffer.prefetch(batch_size, length, depth=depth, device=device,
                                  pin_memory=pin_memory, transform=shape, **sample_kwargs)


def dataset(facade, batch_size: int, length: int, shape, batches, seed, **sample_kwargs):
    """``Buffer.dataset`` of the facade's buffer, each batch passed through ``shape``."""
    facade._check_open()
    return facade.buffer.dataset(batch_size, length, batches=batches, seed=seed,
                                 transform=shape, **sample_kwargs)
