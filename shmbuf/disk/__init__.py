"""A buffer's steps copied out and back: the checkpoint copy loop (in memory or
to disk), the save format, and keyed rings' saves."""
