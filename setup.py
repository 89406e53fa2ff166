"""The one compiled piece: reducer_wire._kernels (wire conversions in C).

Everything else is declared in pyproject.toml. The extension is optional: where
no C compiler is at hand the build goes on without it and reducer_wire.convert
does the same conversions, more slowly, in NumPy.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("reducer_wire._kernels",
                             ["protos/python/reducer_wire/_kernels.c"],
                             extra_compile_args=["-O3"], optional=True)])
