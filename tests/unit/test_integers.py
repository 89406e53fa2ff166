"""reducer_client.integers: Horovod's integer scaling, and the daemon's int64 accumulator."""

import numpy as np
import pytest
from reducer_client.integers import horovod_scale, integer_wire_for
from reducer_wire import dtypes

from reducerd.core import accumulate


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "int64"])
def test_each_integer_dtype_has_its_own_wire(dtype):
    wire = integer_wire_for(np.zeros(3, dtype), "sum", "k")
    assert wire in dtypes.INTEGER_WIRES
    assert accumulate.accumulator_nbytes(wire, 10) == 80  # int64 accumulator
    assert accumulate.new_accumulator(wire, 10).dtype == np.int64


def test_floats_have_no_integer_wire_and_mean_on_integers_is_refused():
    assert integer_wire_for(np.zeros(3, np.float32), "mean", "k") is None
    with pytest.raises(ValueError, match="integer allreduce sums only"):
        integer_wire_for(np.zeros(3, np.int32), "mean", "k")


def test_scaling_truncates_toward_zero_in_float64_as_horovod():
    values = np.array([7, -7, 5, -5, 1, 0], np.int32)
    assert horovod_scale(values, 0.5).tolist() == [3, -3, 2, -2, 0, 0]
    assert horovod_scale(values, 1.0) is values
    big = np.array([2**40 + 1], np.int64)  # exact in float64, not in float32
    assert horovod_scale(big, 3.0).tolist() == [3 * (2**40 + 1)]


def test_the_float32_accumulator_stays_for_float_wires():
    assert accumulate.accumulator_nbytes(dtypes.WIRE_DTYPES["float16"], 10) == 40
