"""DIAMOND's buffer under its upstream names: ``from shmbuf.diamond import ReplayBuffer``."""
from .compat.diamond import ReplayBuffer, SequenceDataset

__all__ = ["ReplayBuffer", "SequenceDataset"]
