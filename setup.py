"""The one compiled piece: reducer_client._fastwire (wire conversions in C).

Everything else is declared in pyproject.toml. The extension is optional: where
no C compiler is at hand the build goes on without it and reducer_client.wire
does the same conversions, more slowly, in NumPy.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("reducer_client._fastwire",
                             ["clients/reducer_client/_fastwire.c"],
                             extra_compile_args=["-O3"], optional=True)])
