"""Which gradients a TF step reduces together, over the in-process LocalGroup.

Scenario 1 (two tapes, Horovod's GAN loop): a generator tape and a
discriminator tape, both with the default name and one equally sized
gradient each, on the int8 wire (error feedback on). The generator's
gradients are ~1000, the discriminator's 0.001: each tape's residual must
stay its own (it was shared: the generator's landed in the discriminator's
gradient, +-4.1 instead of 0.001), and join() must copy both models.

Scenario 2 (None gradients): rank 0 has a gradient for `a` only, rank 1 for
`b` only, both of the same size; the mean is a's over both ranks with zeros
for rank 1 and b's likewise (they were fused side by side and a's summed
with b's). A variable no rank has a gradient for stays None. In a
tf.function a None is fixed when the step is traced, so a rank that traced
None where another rank has a gradient fails the step loudly.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import reducer_client.tensorflow as rtf  # noqa: E402
from reducer_client.tensorflow.steps import joinable  # noqa: E402
from reducer_client.testing import LocalClient, LocalGroup  # noqa: E402
from test_tf_shim import on_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_two_tapes_keep_their_own_residuals_and_join_copies_both():
    client = LocalGroup(1, wire_dtype="int8").client(0)
    gen = tf.Variable(tf.zeros(128), name="gen")
    disc = tf.Variable(tf.zeros(128), name="disc")
    big = tf.constant(1000.0 + np.arange(128) * 0.37, tf.float32)
    small = tf.fill([128], 0.001)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(gen * big)
        g_grad = rtf.DistributedGradientTape(tape, reducer=client).gradient(loss, [gen])[0]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(disc * small)
        d_grad = rtf.DistributedGradientTape(tape, reducer=client).gradient(loss, [disc])[0]
        # int8: one scale per block of equal values, so 0.001 comes back within
        # half a step of 0.001/127; the big gradient within its own blocks' step.
        np.testing.assert_allclose(d_grad.numpy(), 0.001, atol=1e-5)
        np.testing.assert_allclose(g_grad.numpy(), big.numpy(), rtol=0.01)
    copied = [v.name for steps in joinable(client) for v in steps.variables()]
    assert sorted(copied) == ["disc:0", "gen:0"]


def test_one_tape_keeps_its_key_and_steps():
    client = LocalGroup(1).client(0)
    var = tf.Variable(tf.ones([3]))
    tapes = []
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var * 2.0)
        tapes.append(rtf.DistributedGradientTape(tape, reducer=client))
        tapes[-1].gradient(loss, [var])
    assert tapes[0]._steps is tapes[1]._steps
    assert [list(s.variables()) for s in joinable(client)] == [[var]]


def test_none_gradients_of_different_variables_on_different_ranks():
    def step(client):
        a, b, unused = tf.Variable(tf.zeros(4)), tf.Variable(tf.zeros(4)), tf.Variable(1.0)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * 1.0) if client.rank == 0 else tf.reduce_sum(b * 100.0)
        grads = rtf.DistributedGradientTape(tape, reducer=client).gradient(loss, [a, b, unused])
        return [None if g is None else g.numpy() for g in grads]

    for ga, gb, gu in on_ranks(2, step):
        np.testing.assert_array_equal(ga, np.full(4, 0.5, np.float32))
        np.testing.assert_array_equal(gb, np.full(4, 50.0, np.float32))
        assert gu is None


class _OtherRankHas(LocalClient):
    """A one-rank client whose results add a second rank that had every gradient."""

    def __init__(self, count: int) -> None:
        super().__init__(LocalGroup(1), 0)
        self.count = count

    def allreduce(self, array, key, op="sum", **kwargs):
        out = np.array(super().allreduce(array, key, op, **kwargs), copy=True)
        out[-2 * self.count:-self.count] += 1.0  # its presence flags
        return out


def test_none_traced_in_a_tf_function_fails_when_another_rank_has_the_gradient():
    a, b = tf.Variable(tf.ones([2])), tf.Variable(tf.ones([2]))
    reducer = _OtherRankHas(2)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * 3.0)
        return rtf.DistributedGradientTape(tape, reducer=reducer).gradient(loss, [a, b])

    with pytest.raises(tf.errors.OpError, match="None on this rank"):
        step()
