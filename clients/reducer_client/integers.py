"""Integer allreduce: exact sums on the integer wires, Horovod's integer scaling.

An integer array travels as its own dtype (reducer_wire.dtypes: the integer
wires) and the daemons sum it exactly in int64, wrapping around to the
dtype's width on overflow, as the dtype's own addition (and Horovod's MPI or
Gloo sum) does. The daemons only sum integers: an average, and Horovod's
prescale_factor / postscale_factor, are scalings done here as Horovod does
them (ScaleBufferCPUImpl: `output = scale_factor * input` with a double
factor): the product in float64, truncated toward zero, cast to the dtype.
Average is a postscale of 1 / size.
"""

from __future__ import annotations

import numpy as np
from reducer_wire import dtypes

__all__ = ["INTEGER_INPUTS", "integer_wire_for", "is_integer", "horovod_scale"]

INTEGER_INPUTS: tuple[str, ...] = ("uint8", "int8", "int16", "int32", "int64")


def is_integer(dtype: np.dtype) -> bool:
    """Whether arrays of `dtype` allreduce on an integer wire."""
    return dtypes.integer_wire(dtype) is not None


def integer_wire_for(array: np.ndarray, op: str, key: str) -> int | None:
    """The integer wire enum for `array`, or None for a non-integer array.

    ValueError for op "mean": integers are summed, the caller scales the sum
    (horovod_scale), so that the rounding is Horovod's, not the daemon's.
    """
    wire = dtypes.integer_wire(array.dtype)
    if wire is not None and op != "sum":
        raise ValueError(f"key {key!r}: op {op!r} on {array.dtype}: integer allreduce "
                         "sums only (scale the sum for an average: "
                         "reducer_client.integers.horovod_scale)")
    return wire


def horovod_scale(values: np.ndarray, factor: float) -> np.ndarray:
    """`values` (an integer array) times `factor` as Horovod scales integers.

    In float64, truncated toward zero, then cast to the dtype; a product
    outside the dtype's range wraps around through int64 (where C++'s cast
    is undefined). A factor of 1 returns `values` itself.
    """
    if factor == 1.0:
        return values
    scaled = np.trunc(values.astype(np.float64) * float(factor))
    with np.errstate(invalid="ignore"):
        return scaled.astype(np.int64).astype(values.dtype)
