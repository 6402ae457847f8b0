"""One POSIX shared-memory segment: create, attach, close, unlink, errno
translation; the lifecycle every object over a segment shares; mapping a
chunk's pages before its first write."""
