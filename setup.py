"""Declares the C extensions; everything else lives in setup.cfg."""
import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmbuf.protocol._atomic",
            sources=["shmbuf/protocol/_atomic.c"],
            include_dirs=[numpy.get_include()],   # the writer's fast path reads ndarrays
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf.protocol._window_check",
            sources=["shmbuf/protocol/_window_check.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf.protocol._prio",
            sources=["shmbuf/protocol/_prio.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf.posix._exitsig",
            sources=["shmbuf/posix/_exitsig.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
    ]
)
