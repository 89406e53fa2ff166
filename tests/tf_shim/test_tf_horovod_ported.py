"""What Horovod's own TensorFlow tests need of the shim, one check each.

Eager checks run 2 ranks as threads of one LocalGroup; the TF1-graph checks
(sessions, tf.gradients) run in 2 real worker processes against real daemons
(one launch for all of them: importing TensorFlow costs seconds a process),
since two threads blocking in TensorFlow's shared inter-op pool could wait on
each other. Values are small integers or exact copies, so results compare
exactly (the float32 wire is exact for them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import reducer_client.tensorflow as rtf  # noqa: E402
from reducer_client import ReducerError  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from support import run_workers  # noqa: E402

WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
              "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def on_ranks(fn, world_size: int = 2) -> list:
    """fn(reducer) on thread ranks of one LocalGroup (float32 wire); each result
    or the exception it raised."""
    group = LocalGroup(world_size, timeout=15, wire_dtype="float32")
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, group.client(r)) for r in range(world_size)]
        out = []
        for future in futures:
            try:
                out.append(future.result(timeout=60))
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out.append(exc)
        return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["allreduce", "allgather", "broadcast"])
def test_eager_mismatch_is_failed_precondition_and_reducer_error(call):
    def work(reducer):
        r = reducer.rank
        if call == "allreduce":
            return rtf.allreduce(tf.ones([3 + r]), op=rtf.Sum, reducer=reducer)
        if call == "allgather":
            return rtf.allgather(tf.ones([2, 2 + r]), reducer=reducer)
        return rtf.broadcast(tf.ones([3]), root_rank=r, reducer=reducer)
    for error in on_ranks(work):
        assert isinstance(error, tf.errors.FailedPreconditionError), error
        assert isinstance(error, ReducerError)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "ranks disagree" in str(error) and "rank 0" in str(error)


@pytest.mark.timeout(60)
def test_indexed_slices_without_dense_shape_are_gathered():
    """Horovod's sparse allreduce: every rank's values and indices, in rank
    order; Average divides the values by size()."""
    def work(reducer):
        r = reducer.rank
        values = tf.constant([[r + 1.0, 2.0 * r]] * (r + 1))
        slices = tf.IndexedSlices(values, tf.constant(list(range(r, 2 * r + 1))))
        summed = rtf.allreduce(slices, op=rtf.Sum, reducer=reducer)
        averaged = rtf.allreduce(slices, reducer=reducer)
        with pytest.raises(NotImplementedError, match="prescale"):
            rtf.allreduce(slices, op=rtf.Sum, prescale_factor=0.5, reducer=reducer)
        grouped = rtf.grouped_allreduce([slices, tf.fill([2], r + 1.0)], op=rtf.Sum,
                                        reducer=reducer)
        return summed, averaged, grouped
    expected_values = np.array([[1.0, 0.0], [2.0, 2.0], [2.0, 2.0]])
    for summed, averaged, grouped in on_ranks(work):
        assert isinstance(summed, tf.IndexedSlices) and summed.dense_shape is None
        np.testing.assert_array_equal(summed.values, expected_values)
        np.testing.assert_array_equal(summed.indices, [0, 1, 2])
        np.testing.assert_array_equal(averaged.values, expected_values / 2)
        assert isinstance(grouped[0], tf.IndexedSlices)
        np.testing.assert_array_equal(grouped[0].values, expected_values)
        np.testing.assert_array_equal(grouped[1], [3.0, 3.0])


@pytest.mark.timeout(60)
def test_eager_gradients_of_allgather_broadcast_and_grouped_allreduce():
    """Horovod's gradients: allgather's is this rank's rows of the averaged
    upstream gradient, broadcast's the average on the root and zeros
    elsewhere, grouped_allreduce's the same grouped allreduce."""
    def work(reducer):
        r = reducer.rank
        x = tf.Variable(tf.ones([r + 1, 2]))
        y = tf.Variable([1.0, 2.0])
        z = tf.Variable(tf.ones([2, 2]))
        with tf.GradientTape(persistent=True) as tape:
            gathered = rtf.allgather(x * 1.0, reducer=reducer)  # 3 rows
            sent = rtf.broadcast(y * 1.0, root_rank=1, reducer=reducer)
            summed = rtf.grouped_allreduce([z * 1.0, y * 1.0], op=rtf.Sum, reducer=reducer)
        upstream = tf.constant([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]) * (r + 1)
        g_gather = tape.gradient(gathered, x, upstream)
        g_send = tape.gradient(sent, y, tf.constant([1.0, 3.0]) * (r + 1))
        g_sum = tape.gradient(summed, [z, y])
        return r, g_gather, g_send, g_sum
    for r, g_gather, g_send, g_sum in on_ranks(work):
        mean_upstream = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]) * 1.5
        rows = mean_upstream[:1] if r == 0 else mean_upstream[1:]
        np.testing.assert_array_equal(g_gather, rows)
        np.testing.assert_array_equal(g_send, [1.5, 4.5] if r == 1 else [0.0, 0.0])
        np.testing.assert_array_equal(g_sum[0], np.full((2, 2), 2.0))
        np.testing.assert_array_equal(g_sum[1], [2.0, 2.0])


@pytest.mark.timeout(60)
def test_object_collectives_work_while_a_graph_is_built():
    """broadcast_object / allgather_object go through the core, not TF ops:
    the same in a TF1 graph with no session as eagerly."""
    def work(reducer):
        r = reducer.rank
        with tf.Graph().as_default():
            got = rtf.broadcast_object({"rank": r, "list": [r] * 3}, root_rank=1,
                                       reducer=reducer)
            every = rtf.allgather_object({"rank": r} if r else "zero", reducer=reducer)
        fn = rtf.broadcast_object_fn(root_rank=0, reducer=reducer)
        return got, every, fn(("from", r))
    for got, every, from_fn in on_ranks(work):
        assert got == {"rank": 1, "list": [1, 1, 1]}
        assert every == ["zero", {"rank": 1}]
        assert from_fn == ("from", 0)


@pytest.mark.timeout(60)
def test_broadcast_global_variables_callback_keeps_local_variables():
    def work(reducer):
        r = reducer.rank
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
            2, kernel_initializer=keras.initializers.Constant(float(r)),
            bias_initializer=keras.initializers.Constant(float(r)))])
        local = [model.layers[0].bias]
        callback = rtf.callbacks.BroadcastGlobalVariablesCallback(
            root_rank=1, reducer=reducer, local_variables=local)
        callback.set_model(model)
        callback.on_train_begin()
        return r, model.layers[0].kernel.numpy(), model.layers[0].bias.numpy()
    for r, kernel, bias in on_ranks(work):
        np.testing.assert_array_equal(kernel, np.full((2, 2), 1.0))  # root's
        np.testing.assert_array_equal(bias, np.full(2, float(r)))  # its own


@pytest.mark.timeout(60)
def test_inplace_broadcast_and_grouped_allgather():
    def work(reducer):
        r = reducer.rank
        variables = [tf.Variable(tf.fill([2], float(r))), tf.Variable([r, r + 1])]
        values = rtf.broadcast_(variables, root_rank=1, reducer=reducer)
        gathered = rtf.grouped_allgather([tf.fill([r + 1], r), tf.fill([1, 2], 2.0 * r)],
                                         reducer=reducer)
        with pytest.raises(RuntimeError, match="does not support eager execution"):
            rtf.broadcast_global_variables(0, reducer=reducer)
        return [v.numpy().tolist() for v in variables], [np.asarray(v).tolist()
                                                        for v in values], gathered
    for variables, values, gathered in on_ranks(work):
        assert variables == values == [[1.0, 1.0], [1, 2]]
        assert gathered[0].numpy().tolist() == [0, 1, 1]
        assert gathered[1].numpy().tolist() == [[0.0, 0.0], [2.0, 2.0]]


def test_keras_optimizer_variables_may_be_called_as_in_keras_2():
    variable = tf.Variable([1.0, 2.0])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build([variable])
    assert isinstance(optimizer.variables, list)
    assert optimizer.variables() == optimizer.variables
    assert len(optimizer.variables()) == len(optimizer.variables) >= 2


def test_compile_accepts_experimental_run_tf_function_as_keras_2_did():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", experimental_run_tf_function=False)
    assert model.jit_compile is False  # the reductions are Python ops: no XLA
    model.compile(optimizer="sgd", loss="mse", experimental_run_tf_function=False,
                  jit_compile=True)
    assert model.jit_compile is True  # an explicit jit_compile wins
    with pytest.raises(TypeError):
        model.compile(optimizer="sgd", loss="mse", no_such_argument=1)


def test_horovod_helpers_and_refusals():
    rtf.init(LocalGroup(1).client(0))
    try:
        assert int(rtf.rank_op()) == 0 and int(rtf.size_op()) == 1
        assert int(rtf.local_rank_op()) == 0 and int(rtf.local_size_op()) == 1
        assert rtf._executing_eagerly() and rtf.util._executing_eagerly()
        for name, words in [("alltoall", "alltoall is not supported"),
                            ("reducescatter", "reducescatter is not supported"),
                            ("grouped_reducescatter", "not supported"),
                            ("add_process_set", "process sets are not supported")]:
            with pytest.raises(NotImplementedError, match=words):
                getattr(rtf, name)(tf.ones([2]))
    finally:
        rtf.shutdown()


# -- TF1 graphs, in worker processes ------------------------------------------

def _graph_worker(rank: int, world_size: int, addresses: list[str]) -> dict:
    import os

    os.environ.update(REDUCER_ADDRESSES=",".join(addresses), REDUCER_RANK=str(rank),
                      REDUCER_WORLD_SIZE=str(world_size), REDUCER_JOB="tf-ported-graph",
                      REDUCER_TIMEOUT="15", REDUCER_WIRE_DTYPE="float32")
    import reducer_client.tensorflow as rtf
    import tensorflow as tf

    rtf.init()
    out: dict = {}
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        # A mismatch fails the graph's run with Horovod's class.
        bad = rtf.allreduce(tf.ones([3 + rank]), op=rtf.Sum)
        try:
            session.run(bad)
            out["mismatch"] = "no error"
        except tf.errors.FailedPreconditionError as exc:
            out["mismatch"] = type(exc).__name__
        # Ops made in one order run in that order on every rank, whichever the
        # session would pick: a dtype per op, fetched together in reverse.
        gathered = [rtf.allgather(tf.cast(tf.fill([rank + 1], i), dtype))
                    for i, dtype in enumerate([tf.uint8, tf.int8, tf.int32, tf.float16,
                                               tf.float32, tf.int64])]
        out["fused"] = [a.tolist() for a in session.run(gathered[::-1])]
        # Gradients in a graph (tf.gradients).
        x = tf.ones([rank + 1, 2])
        g_gather = tf.gradients(rtf.allgather(x), x,
                                tf.constant([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))[0]
        y = tf.constant([1.0, 2.0])
        g_send = tf.gradients(rtf.broadcast(y, root_rank=1), y, tf.constant([1.0, 3.0]))[0]
        out["grads"] = [a.tolist() for a in session.run([g_gather, g_send])]
        # broadcast_global_variables: an op that assigns the root's values.
        variable = tf.compat.v1.Variable(tf.fill([2], float(rank)))
        session.run(tf.compat.v1.global_variables_initializer())
        session.run(rtf.broadcast_global_variables(1))
        out["global"] = session.run(variable).tolist()
    rtf.shutdown()
    return out


@pytest.mark.timeout(240)
def test_tf1_graph_mismatch_order_and_gradients(daemons):
    with daemons(2, round_timeout=20) as d:
        results = run_workers(_graph_worker, 2, (d.addresses,), timeout=200, env=WORKER_ENV)
    for rank, out in enumerate(results):
        assert out["mismatch"] == "FailedPreconditionError"
        assert out["fused"] == [[i, i, i] for i in range(5, -1, -1)]
        rows = [[1.0, 1.0]] if rank == 0 else [[2.0, 2.0], [3.0, 3.0]]
        assert out["grads"] == [rows, [1.0, 3.0] if rank == 1 else [0.0, 0.0]]
        assert out["global"] == [1.0, 1.0]
