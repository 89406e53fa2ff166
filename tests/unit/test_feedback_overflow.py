"""Error feedback keeps no residue of an element the wire could not carry.

An element beyond the wire's finite range (E4M3 above 464, E5M2 from
61440) goes out non-finite, as do Inf and NaN, and an int8 block holding
Inf or NaN decodes to NaN whole: the loss scaler skips the step. A residue
kept for such an element (say 1e5 - 448 under a clipping wire) would be
paid out over the next steps, into gradients the scaler has already
judged. So each such element's residue is 0, and every other element's is
exactly what the wire's rounding dropped: v - Q(v), the reference computed
here with reducer_wire.quant directly. Both the worker's own feedback
(ErrorFeedback) and the node's (SliceResidues), with the C kernels and with
NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest
from reducer_client.feedback import ErrorFeedback
from reducer_client.node.residues import SliceResidues
from reducer_wire import convert, dtypes, quant

pytestmark = pytest.mark.timeout(60)

WIRES = ("int8", "fp8_e4m3", "fp8_e5m2")
NUMEL = 3 * quant.INT8_BLOCK
# One bad element per int8 block; elsewhere values well inside every range.
BAD_AT = (5, quant.INT8_BLOCK + 9, 2 * quant.INT8_BLOCK + 100)


def _rounded(values: np.ndarray, wire: str) -> np.ndarray:
    """Q(values): the wire's encoding decoded, straight from reducer_wire.quant."""
    dtype = dtypes.EIGHT_BIT_DTYPES[wire]
    data = np.empty(dtypes.wire_nbytes(dtype, values.size), np.uint8)
    quant.encode(values, dtype, data, use_c=False)
    out = np.empty(values.size, np.float32)
    quant.decode(data, dtype, out, use_c=False)
    return out


@pytest.fixture(params=["c", "numpy"])
def kernels(request):
    if request.param == "c" and not convert.accelerated():
        pytest.skip("the C kernels are not built")
    previous = convert.use_accelerator(request.param == "c")
    yield request.param
    convert.use_accelerator(previous)


def _gradient(bad: float) -> np.ndarray:
    x = np.random.default_rng(3).uniform(-8.0, 8.0, NUMEL).astype(np.float32)
    x[list(BAD_AT)] = bad
    return x


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("bad", [1e5, -1e5, np.inf, -np.inf, np.nan])
def test_no_residue_of_an_element_the_wire_cannot_carry(kernels, wire, bad):
    feedback = ErrorFeedback(wire)
    x = _gradient(bad)
    q = _rounded(x, wire)
    carried = np.isfinite(q)
    # What the wire carries: FP8 the elements within its range; int8 (float32's
    # range) every block without Inf or NaN.
    if wire == "int8":
        blocks_ok = np.isfinite(x).reshape(-1, quant.INT8_BLOCK).all(axis=1)
        expected = np.repeat(blocks_ok, quant.INT8_BLOCK)
    else:
        fmt = quant.E4M3 if wire == "fp8_e4m3" else quant.E5M2
        expected = np.abs(x) < quant.fp8_overflow(fmt)  # False for NaN
    assert carried.tolist() == expected.tolist()
    sent = x.copy()
    feedback.apply("k", sent)
    # Step 2: an ordinary gradient gets the residue; compare it with the definition.
    y = _gradient(1.0)
    got = y.copy()
    feedback.apply("k", got)
    with np.errstate(invalid="ignore"):
        residue = np.where(carried, x - q, 0.0).astype(np.float32)
    assert np.array_equal(got, y + residue)
    assert not residue[~carried].any()
    if wire != "int8" or not np.isfinite(bad):
        assert not carried[list(BAD_AT)].any()  # 1e5: beyond FP8, within int8's range
    if wire == "int8" and not np.isfinite(bad):  # the whole block was lost: no residue in it
        assert not carried.any() and not residue.any()
    if wire != "int8":  # one element lost, the others fed back as ever
        assert carried.sum() == NUMEL - len(BAD_AT) and np.abs(residue).max() > 0


@pytest.mark.parametrize("wire", WIRES)
def test_the_node_senders_residue_drops_the_same_elements(kernels, wire):
    residues = SliceResidues()
    dtype = dtypes.EIGHT_BIT_DTYPES[wire]
    x = _gradient(np.inf)
    residues.want("k")
    residues.apply("k", dtype, x.copy())
    y = _gradient(1.0)
    got = y.copy()
    residues.want("k")
    residues.apply("k", dtype, got)
    q = _rounded(x, wire)
    with np.errstate(invalid="ignore"):
        residue = np.where(np.isfinite(q), x - q, 0.0).astype(np.float32)
    assert np.array_equal(got, y + residue)
    assert np.isfinite(got).all()
