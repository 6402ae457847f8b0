"""Writing steps: the Writer, lossless casts of what callers pass, and the train
ratio's rate limiter that writers and samplers wait on."""
