"""Build hook: the packages, and the native hot loops (optional: without a compiler kvstore runs on its pure-Python
fallbacks).

The packages are found here because two of them live outside kvstore/: connectors/ and configs/ ship as
kvstore.connectors and kvstore.configs (pyproject.toml's package-dir maps them), and setuptools' discovery cannot
combine a find with such a mapping on its own. Every package under kvstore/, connectors/ and configs/ is found, so a
new subpackage needs no edit here.
"""
from setuptools import Extension, find_packages, setup

MAPPED = {"kvstore.connectors": "connectors", "kvstore.configs": "configs"}


def packages() -> list[str]:
    found = find_packages(include=["kvstore", "kvstore.*"])
    for name, folder in MAPPED.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(found)


setup(
    packages=packages(),
    ext_modules=[
        Extension("kvstore._kvindex", ["native/kvindex.c"], extra_compile_args=["-O2"], optional=True),
        Extension("kvstore._kvcopy", ["native/kvcopy.c"], extra_compile_args=["-O2"], optional=True),
        # io_uring over the kernel ABI (no liburing): the SSD tier's ring; without it the SSD tier uses threads
        Extension("kvstore._kvuring", ["native/kvuring.c"], extra_compile_args=["-O2"], optional=True),
        # not a Python module: an LD_PRELOAD library for the remote tier's listening sockets (native/kvbind.c)
        Extension("kvstore._kvbind", ["native/kvbind.c"], extra_compile_args=["-O2"], libraries=["dl"],
                  optional=True),
    ],
)
