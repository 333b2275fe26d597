"""Build hook: the native hot loops are optional; without a compiler kvstore runs on its pure-Python fallbacks."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvstore._kvindex", ["native/kvindex.c"], extra_compile_args=["-O2"], optional=True),
    ]
)
