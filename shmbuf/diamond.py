"""DIAMOND's buffer under its upstream names: ``from shmbuf.diamond import ReplayBuffer``."""
from .compat._diamond_dataset import SequenceDataset
from .compat.diamond import ReplayBuffer

__all__ = ["ReplayBuffer", "SequenceDataset"]
