"""Declares the C extensions; everything else lives in setup.cfg."""
import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmbuf._atomic",
            sources=["shmbuf/_atomic.c"],
            include_dirs=[numpy.get_include()],   # the writer's fast path reads ndarrays
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf._windows",
            sources=["shmbuf/_windows.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf._prio",
            sources=["shmbuf/_prio.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
        Extension(
            "shmbuf._exitsig",
            sources=["shmbuf/_exitsig.c"],
            extra_compile_args=["-std=c11", "-O2"],
        ),
    ]
)
