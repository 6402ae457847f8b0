"""The operating system, as shmbuf uses it: process liveness, the one backoff wait,
/dev/shm page reservations and SIGTERM.  Knows nothing of buffers or their words."""
