"""Drop-in facades for the seed APIs, each a thin translation onto the core store."""
from .._registry import register_lazy

# TorchRL's storage imports torch and torchrl: registered by module, imported on demand.
register_lazy("torchrl.LazyShmStorage", "shmbuf.compat.torchrl")
