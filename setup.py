"""Declares the C extensions; everything else lives in setup.cfg."""
import numpy
from setuptools import Extension, setup

# Word access and the chunk geometry, shared by every protocol extension.
PROTOCOL_HEADERS = ["shmbuf/protocol/shmbuf_words.h"]

setup(
    ext_modules=[
        Extension(
            "shmbuf.protocol._atomic",
            # One extension from one file per concern; they share atomic_module.h.
            sources=["shmbuf/protocol/atomic_words.c", "shmbuf/protocol/rate_gate.c",
                     "shmbuf/protocol/appender.c", "shmbuf/protocol/keyed_read.c"],
            depends=PROTOCOL_HEADERS + ["shmbuf/protocol/atomic_module.h"],
            include_dirs=[numpy.get_include()],   # the writer's fast path reads ndarrays
            # numpy's C API table, shared by the two sources that use it.
            define_macros=[("PY_ARRAY_UNIQUE_SYMBOL", "shmbuf_atomic_ARRAY_API")],
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf.protocol._window_check",
            sources=["shmbuf/protocol/_window_check.c"],
            depends=PROTOCOL_HEADERS,
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf.protocol._rows",
            sources=["shmbuf/protocol/_rows.c"],
            depends=PROTOCOL_HEADERS,
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf.protocol._prio",
            sources=["shmbuf/protocol/_prio.c"],
            depends=PROTOCOL_HEADERS,
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf.posix._exitsig",
            sources=["shmbuf/posix/_exitsig.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
    ]
)
