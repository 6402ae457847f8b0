"""Which rows make a valid window and how windows are drawn: the window finder,
the selectors' draws, one random stream per process, where a batch goes, and
whole episodes read back in order."""
