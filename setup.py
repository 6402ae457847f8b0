"""Declares the C extension; everything else lives in setup.cfg."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmbuf._atomic",
            sources=["shmbuf/_atomic.c"],
            extra_compile_args=["-std=c11", "-O2"],
        )
    ]
)
