"""Drop-in facades for the seed APIs, each a thin translation onto the core store."""
