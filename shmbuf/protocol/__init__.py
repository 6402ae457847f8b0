"""Every load and store of a shared word, Python and C side by side.

``layout`` is the byte table; ``header`` the words every segment has (magic,
closed mark, owner); ``ring`` the step store's chunk table, counters, slots and
episode index; ``streams`` a writer's claims and publishes; ``priorities`` the
shared priority words; ``rate`` the train-ratio words; ``keyed`` the keyed rings'
words.  Nothing outside this package imports the atomics.
"""
