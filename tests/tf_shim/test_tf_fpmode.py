"""The wire's C kernels give the same bits inside TensorFlow's graph ops.

TensorFlow runs graph ops, tf.numpy_function among them (and so our client,
and the threads it starts there, which inherit the mode), with MXCSR's
flush-to-zero and denormals-are-zero bits set. The scalar float16 widening
went through float32 denormals for float16 subnormals, so under DAZ they
came out 0, but only for the elements outside the vector loop: in a 4-rank
Keras run, ranks whose buffers were aligned differently got different
averaged gradients for the same step (tests/tf_shim/test_tf_workers.py
caught it). The kernels now clear both bits while they run
(reducer_wire/_fpmode.h).
"""

from __future__ import annotations

import numpy as np
import pytest
from reducer_wire import convert, dtypes

tf = pytest.importorskip("tensorflow")

_ALIGNMENTS = 16  # output offsets 0..15 floats: every split of head, vector body and tail


def _inputs() -> np.ndarray:
    """float32 values that reach each format's subnormals, around normal ones."""
    halves = np.arange(1, 1024, dtype=np.uint16)  # every positive float16 subnormal
    f16_subnormals = halves.view(np.float16).astype(np.float32)
    tiny = np.float32(2.0) ** -np.arange(120, 149, dtype=np.float32)  # float32 denormals too
    block = np.concatenate([np.full(5, 3e-41, np.float32), np.zeros(123, np.float32)])
    values = np.concatenate([f16_subnormals, -f16_subnormals, tiny, block,
                             np.linspace(-2, 2, 77, dtype=np.float32)])
    return values.astype(np.float32)


def _round_trips(wire: int, values: np.ndarray) -> np.ndarray:
    """to_wire, then from_wire into outputs at every alignment; the wire bytes
    and the widened results, as one uint32 array."""
    payload = convert.to_wire(values, wire)
    outs = [payload.view(np.uint8).astype(np.uint32)]
    for start in range(_ALIGNMENTS):
        out = np.empty(values.size + _ALIGNMENTS, np.float32)[start:start + values.size]
        convert.from_wire(payload, wire, out)
        outs.append(out.view(np.uint32).copy())
    return np.concatenate(outs)


# The NumPy fallback too, but for int8: its scales of blocks whose largest
# value is a float32 denormal (below 2^-126) are float32 arithmetic, which a
# DAZ thread flushes (reducer_wire.convert's docstring says so).
@pytest.mark.parametrize("path", ["c", "numpy"])
@pytest.mark.parametrize("wire_name", ["float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_kernels_give_the_same_bits_inside_a_tensorflow_graph(wire_name, path):
    if path == "numpy" and wire_name == "int8":
        pytest.skip("int8's NumPy fallback rounds float32-denormal blocks under DAZ")
    wire = dtypes.WIRE_DTYPES[wire_name]
    values = _inputs()
    previous = convert.use_accelerator(path == "c")
    try:
        _check_same_bits_inside_a_graph(wire_name, wire, values)
    finally:
        convert.use_accelerator(previous)


def _check_same_bits_inside_a_graph(wire_name: str, wire: int, values: np.ndarray) -> None:
    plain = _round_trips(wire, values)

    def run(_: np.ndarray) -> np.ndarray:
        return _round_trips(wire, values)

    graph = tf.function(lambda: tf.numpy_function(run, [tf.constant(0.0)], tf.uint32))
    inside = graph().numpy()
    assert inside.shape == plain.shape
    wrong = np.flatnonzero(inside != plain)
    assert wrong.size == 0, f"{wrong.size} words differ inside the graph, first at {wrong[:5]}"
    if wire_name == "float16":  # and the plain result is the exact one
        exact = values.astype(np.float16).astype(np.float32).view(np.uint32)
        assert np.array_equal(plain[-values.size:], exact)
