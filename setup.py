"""The compiled pieces: reducer_wire._kernels (float16 / bfloat16 conversions in
C), reducer_wire._quant (the 8-bit wire formats in C, one source per format)
and reducer_wire._codec (the Shard header parse), the daemon's
reducerd.core._sumpool (its summing threads in C, over the kernels' C API,
reducer_wire/_api.h) and the client's reducer_client.transport._tcploop (its
TCP data plane per chunk, over the same C API), reducerd.core._budget
(MemoryBudget's counters, with a C API) and reducerd.dataplane._cplane (the C
data loop for plain-TCP data-plane connections, over the budget's C API).

Everything else is declared in pyproject.toml. The extensions are optional:
where no C compiler is at hand the build goes on without them and
reducer_wire.convert, .quant and .codec do the same work, more slowly, in
NumPy, with the same bits, and the daemon's data plane runs in Python
(reducerd.dataplane.loop_reader).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("reducer_wire._kernels", ["protos/python/reducer_wire/_kernels.c"],
              depends=["protos/python/reducer_wire/_fpmode.h",
                       "protos/python/reducer_wire/_api.h"],
              extra_compile_args=["-O3"], optional=True),
    Extension("reducer_wire._quant", ["protos/python/reducer_wire/_quant.c",
                                      "protos/python/reducer_wire/_quant_int8.c",
                                      "protos/python/reducer_wire/_quant_fp8.c"],
              depends=["protos/python/reducer_wire/_quant.h",
                       "protos/python/reducer_wire/_fpmode.h",
                       "protos/python/reducer_wire/_api.h"],
              extra_compile_args=["-O3", "-fvisibility=hidden"], libraries=["m"],
              optional=True),
    Extension("reducerd.core._sumpool", ["reducerd/core/_sumpool.c",
                                         "reducerd/core/_sumpool_threads.c",
                                         "reducerd/core/_sumpool_tasks.c"],
              depends=["reducerd/core/_sumpool.h", "protos/python/reducer_wire/_api.h"],
              extra_compile_args=["-O3", "-fvisibility=hidden"], optional=True),
    Extension("reducer_wire._codec", ["protos/python/reducer_wire/_codec.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("reducer_client.transport._tcploop",
              ["clients/reducer_client/transport/_tcploop.c"],
              depends=["protos/python/reducer_wire/_api.h"],
              extra_compile_args=["-O2", "-fvisibility=hidden"], optional=True),
    Extension("reducerd.core._budget", ["reducerd/core/_budget.c"],
              depends=["reducerd/core/_budget.h"],
              extra_compile_args=["-O2", "-fvisibility=hidden"], optional=True),
    Extension("reducerd.dataplane._cplane", ["reducerd/dataplane/_cplane.c",
                                             "reducerd/dataplane/_cplane_loop.c",
                                             "reducerd/dataplane/_cplane_conn.c"],
              depends=["reducerd/dataplane/_cplane.h", "reducerd/core/_budget.h"],
              extra_compile_args=["-O2", "-fvisibility=hidden"], optional=True),
])
