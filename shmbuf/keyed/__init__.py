"""Keyed rings: a store kind with a fixed set of keys, each keeping its newest
entries (HistoryBuffer's, and ParamBlock's with one key)."""
