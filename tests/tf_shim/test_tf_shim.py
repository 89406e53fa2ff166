"""reducer_client.tensorflow in one process, over the in-process LocalGroup.

Fast checks of the shim's own logic: one fused call per step, dtypes and
shapes, IndexedSlices, exact broadcast, serialization, XLA refusal, init().
Ranks of a LocalGroup are threads here; they run eagerly (graph-mode steps
use a one-rank group), since two threads blocking inside TensorFlow's shared
inter-op pool could wait on each other.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import reducer_client.tensorflow as rtf  # noqa: E402
from reducer_client import ReducerClient, collectives  # noqa: E402
from reducer_client.api import Reducer  # noqa: E402
from reducer_client.tensorflow._bridge import _FLAG_ALIGN  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402


class Recording:
    """A Reducer that records every blocking call and forwards it."""

    def __init__(self, inner: Reducer) -> None:
        self.inner = inner
        self.rank, self.world_size, self.timeout = inner.rank, inner.world_size, inner.timeout
        self.local_rank, self.local_size = inner.local_rank, inner.local_size
        self.wire_dtype = inner.wire_dtype
        self.calls: list[tuple[str, str, int]] = []

    def allreduce(self, array, key, op="sum", *, out=None):
        self.calls.append(("allreduce", key, array.size))
        return self.inner.allreduce(array, key, op, out=out)

    def broadcast(self, array, key, root_rank=0):
        self.calls.append(("broadcast", key, array.size))
        return self.inner.broadcast(array, key, root_rank)

    def allreduce_async(self, array, key, op="sum", *, out=None):
        return self.inner.allreduce_async(array, key, op, out=out)

    def broadcast_async(self, array, key, root_rank=0):
        return self.inner.broadcast_async(array, key, root_rank)

    def close(self):
        self.inner.close()


@pytest.fixture
def single():
    """init() with a recording one-rank reducer; shut down afterwards."""
    reducer = Recording(LocalGroup(1).client(0))
    rtf.init(reducer)
    yield reducer
    rtf.shutdown()


def on_ranks(world_size, fn):
    """Run fn(reducer) on `world_size` thread ranks of one LocalGroup."""
    group = LocalGroup(world_size, timeout=20)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, group.client(r)) for r in range(world_size)]
        return [f.result(timeout=60) for f in futures]


def step_size(numel, count):
    """Elements of a fused step (_bridge.reduce_gradients): the gradients, zeros to a
    whole block, a presence and a dropped flag per gradient."""
    return -(-numel // _FLAG_ALIGN) * _FLAG_ALIGN + 2 * count


def small_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                             keras.layers.Dense(1)])


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)


# -- DistributedOptimizer --------------------------------------------------

@pytest.mark.parametrize("run_eagerly", [False, True])
def test_fit_sends_one_fused_call_per_step(single, run_eagerly):
    model = small_model()
    model.compile(optimizer=rtf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  run_eagerly=run_eagerly, jit_compile=False)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    numel = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # 4 steps x 2 epochs
    assert single.calls == [("allreduce", "tf/optimizer/4", step_size(numel, 4))] * 8


def test_unnamed_optimizers_of_one_client_get_their_own_keys(single):
    # A GAN's two optimizers with as many gradients each: one shared key would
    # share its error-feedback residues (kept per key) between the two models.
    models = [small_model(0), keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                                keras.layers.Dense(2)])]
    optimizers = [rtf.DistributedOptimizer(keras.optimizers.SGD(0.1)) for _ in models]
    named = rtf.DistributedOptimizer(keras.optimizers.SGD(0.1), name="critic")
    x = tf.constant(data()[0])
    for _ in range(2):
        for model, optimizer in zip([*models, models[0]], [*optimizers, named], strict=True):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x) ** 2)
            optimizer.apply(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables)
    keys = [key for _, key, _ in single.calls]
    assert keys == ["tf/optimizer/4", "tf/optimizer.1/4", "tf/critic/4"] * 2


# Keras 3.15's own saving code trips NumPy 2's __array__(copy=) deprecation.
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_wrapped_optimizer_keeps_class_config_and_saves(single, tmp_path):
    base = keras.optimizers.Adam(learning_rate=0.003, beta_1=0.8)
    opt = rtf.DistributedOptimizer(base)
    assert isinstance(opt, keras.optimizers.Adam) and opt is not base
    assert opt.get_config() == base.get_config()
    model = small_model()
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)

    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.Adam
    assert plain.optimizer.get_config() == opt.get_config()
    loaded = rtf.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations.numpy()) == 4
    for a, b in zip(loaded.optimizer.variables, opt.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    calls = len(single.calls)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(single.calls) == calls + 4  # the loaded optimizer reduces again

    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        rtf.DistributedOptimizer(opt)
    with pytest.raises(ValueError, match="already holds state"):
        rtf.DistributedOptimizer(plain.optimizer)


def test_jit_compile_fails_with_instructions(single):
    model = small_model()
    model.compile(optimizer=rtf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=True)
    x, y = data()
    with pytest.raises(ValueError, match=r"jit_compile=False"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)

    @tf.function(jit_compile=True)
    def step(t):
        return rtf.allreduce(t, name="xla")
    with pytest.raises(ValueError, match=r"XLA cannot compile"):
        step(tf.ones([3]))


# -- DistributedGradientTape and allreduce ----------------------------------

def test_tape_in_tf_function_fuses_nested_sources(single):
    a = tf.Variable(tf.ones([2, 3]))
    b = tf.Variable(tf.ones([4], dtype=tf.float64))
    unused = tf.Variable(1.0)

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * 2.0) + tf.cast(tf.reduce_sum(b * b), tf.float32)
        return rtf.DistributedGradientTape(tape).gradient(
            loss, {"a": a, "nested": [b, unused]})

    out = grads()
    np.testing.assert_array_equal(out["a"], np.full([2, 3], 2.0))
    assert out["nested"][0].dtype == tf.float64 and out["nested"][1] is None
    np.testing.assert_array_equal(out["nested"][0], np.full([4], 2.0))
    grads()
    assert single.calls == [("allreduce", "tf/tape/3", step_size(11, 3))] * 2


def test_allreduce_mean_sum_and_dtypes():
    def work(reducer):
        value = tf.constant([1.0, 2.0, 3.0], tf.float16) * (reducer.rank + 1)
        mean = rtf.allreduce(value, name="m", reducer=reducer)
        total = rtf.allreduce(value, name="s", op="sum", reducer=reducer)
        return mean, total
    for mean, total in on_ranks(2, work):
        assert mean.dtype == tf.float16 and total.dtype == tf.float16
        np.testing.assert_array_equal(mean, [1.5, 3.0, 4.5])
        np.testing.assert_array_equal(total, [3.0, 6.0, 9.0])
    with pytest.raises(ValueError, match="op 'max'"):
        rtf.allreduce(tf.ones([2]), name="x", op="max", reducer=LocalGroup(1).client(0))
    with pytest.raises(TypeError, match="bool cannot be reduced"):
        rtf.allreduce(tf.ones([2], tf.bool), name="x", reducer=LocalGroup(1).client(0))


def test_indexed_slices_are_reduced_as_their_dense_sum():
    """Each rank has slices with a repeated index; the result is the mean of
    the dense gradients (rows of a repeated index add up), float64 reference."""
    rng = np.random.default_rng(3)
    indices = [np.array([0, 3, 3]), np.array([1, 3])]
    values = [rng.normal(size=(n, 2)).astype(np.float32) for n in (3, 2)]
    expected = np.zeros((5, 2))
    for idx, val in zip(indices, values, strict=True):
        np.add.at(expected, idx, val.astype(np.float64))
    expected /= 2

    def work(reducer):
        r = reducer.rank
        grad = tf.IndexedSlices(tf.constant(values[r]), tf.constant(indices[r]),
                                tf.constant([5, 2], tf.int64))
        return rtf.allreduce(grad, name="emb", reducer=reducer)
    for out in on_ranks(2, work):
        np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_embedding_gradient_is_indexed_slices_and_reduced(single):
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 2),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    tokens = tf.constant([[1, 2, 2], [3, 1, 1]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tokens))
    plain = tape.gradient(loss, model.trainable_variables)
    assert isinstance(plain[0], tf.IndexedSlices)  # the sparse path is exercised
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tokens))
    reduced = rtf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    np.testing.assert_allclose(reduced[0], tf.convert_to_tensor(plain[0]), rtol=1e-6)
    assert reduced[0].shape == (10, 2)


# -- broadcasts ------------------------------------------------------------

BROADCAST_VALUES = {
    "float32": np.array([1.5, -2.5e-45, 3.4e38], np.float32),  # not -0.0: see below
    "float64": np.array([np.pi, 1e-300, -2.0 ** 60 + 1], np.float64),
    "float16": np.array([65504.0, 1e-7], np.float16),
    "int64": np.array([-(2 ** 62) - 3, 2 ** 53 + 1, 7], np.int64),
    "int32": np.array([[-(2 ** 31), 2 ** 31 - 1]], np.int32),
    "uint8": np.array([0, 255], np.uint8),
    "bool": np.array([True, False]),
}


def test_broadcast_variables_is_bit_exact_for_every_dtype():
    """Every dtype arrives bit for bit, except that -0.0 in a float32, float16
    or bfloat16 variable arrives as +0.0 (root's -0.0 plus the others' zeros)."""
    def work(reducer):
        scale = 1 if reducer.rank == 0 else 0
        variables = [tf.Variable(v * scale if v.dtype != bool else v ^ (scale == 0))
                     for v in BROADCAST_VALUES.values()]
        variables.append(tf.Variable(tf.constant([1.25, -3.0], tf.bfloat16) * scale))
        rtf.broadcast_variables(variables, root_rank=0, reducer=reducer)
        return [v.numpy() for v in variables]
    for values in on_ranks(2, work):
        for got, want in zip(values, BROADCAST_VALUES.values(), strict=False):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(values[-1].astype(np.float32), [1.25, -3.0])


def test_broadcast_callback_copies_model_and_optimizer_state():
    # Built here, not in the rank threads: Keras' random seed is process-wide.
    models = [small_model(seed=rank) for rank in range(2)]
    root_weights = models[0].get_weights()

    def work(reducer):
        model = models[reducer.rank]
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        model.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
        optimizer.build(model.trainable_variables)
        if reducer.rank == 0:
            optimizer.iterations.assign(41)
        callback = rtf.BroadcastGlobalVariablesCallback(root_rank=0, reducer=reducer)
        callback.set_model(model)
        callback.on_train_begin()
        callback.on_train_begin()  # once only: no second round
        return model.get_weights(), int(optimizer.iterations.numpy())

    for weights, iterations in on_ranks(2, work):
        assert iterations == 41
        for got, want in zip(weights, root_weights, strict=True):
            np.testing.assert_array_equal(got, want)


def test_broadcast_tensor_in_graph(single):
    @tf.function
    def f(t):
        return rtf.broadcast(t, root_rank=0, name="t")
    np.testing.assert_array_equal(f(tf.constant([7, -9], tf.int64)), [7, -9])
    # One checked broadcast (reducer_client.collectives): a control round and the data.
    assert single.inner._rounds == {"hvd/control/1": 1, "hvd/data/1": 1}


def test_unnamed_calls_share_bounded_keys():
    """Unnamed allreduce and broadcast of changing shapes and dtypes pair up
    in call order, under a control key and data keys taken in turn: the
    client's keys do not grow with the calls."""
    shapes = [(3,), (2, 2), (7,), (1,), (3,)] * 4

    def work(reducer):
        sums, copies = [], []
        for i, shape in enumerate(shapes):
            dtype = tf.float64 if i % 3 else tf.float32
            value = tf.fill(shape, tf.constant(float(reducer.rank + i), dtype))
            sums.append(rtf.allreduce(value, op="sum", reducer=reducer).numpy())
            copies.append(rtf.broadcast(value, root_rank=1, reducer=reducer).numpy())
        return sums, copies, dict(reducer._rounds)
    for sums, copies, rounds in on_ranks(2, work):
        for i, (total, copy) in enumerate(zip(sums, copies, strict=True)):
            assert total.shape == shapes[i] and np.all(total == 2 * i + 1)
            assert np.all(copy == i + 1)
        # Checked calls (reducer_client.collectives): a control key and data keys.
        data = {key: n for key, n in rounds.items() if key.startswith(collectives.DATA_KEY)}
        assert set(data) == {collectives.data_key(i) for i in range(1, 2 * len(shapes) + 1)}
        assert sum(data.values()) == 2 * len(shapes)
        assert sum(rounds.values()) == 4 * len(shapes)  # a control round per call
        assert len(rounds) == 2 * collectives.DATA_KEYS


def test_results_stay_valid_after_later_calls(single):
    """TensorFlow keeps the returned array's memory as the tensor: every call
    must answer in memory of its own, never a buffer a later call reuses."""
    @tf.function
    def step(x):
        return rtf.allreduce(x, name="g")
    first_eager = rtf.allreduce(tf.fill([1000], 1.0), name="e")
    first_graph = step(tf.fill([1000], 2.0))
    for value in range(3, 6):
        rtf.allreduce(tf.fill([1000], float(value)), name="e")
        step(tf.fill([1000], float(value)))
    assert np.all(first_eager.numpy() == 1.0) and np.all(first_graph.numpy() == 2.0)


# -- init ------------------------------------------------------------------

def test_basics_are_the_process_wide_client():
    reducer = rtf.init(LocalGroup(3).client(2))
    try:
        assert rtf.client() is reducer and rtf.is_initialized()
        assert (rtf.rank(), rtf.size(), rtf.local_rank(), rtf.local_size()) == (2, 3, 2, 3)
        assert rtf.callbacks.BroadcastGlobalVariablesCallback is \
            rtf.BroadcastGlobalVariablesCallback
    finally:
        rtf.shutdown()
    assert not rtf.is_initialized()
    for basic in (rtf.client, rtf.rank, rtf.size, rtf.local_rank, rtf.local_size):
        with pytest.raises(RuntimeError, match=r"call reducer_client\.tensorflow\.init\(\)"):
            basic()


def test_init_and_errors_before_init(monkeypatch):
    rtf.shutdown()
    with pytest.raises(RuntimeError, match=r"call reducer_client.tensorflow.init\(\)"):
        rtf.allreduce(tf.ones([2]), name="x")
    monkeypatch.setenv("REDUCER_ADDRESSES", "127.0.0.1:1")
    monkeypatch.setenv("REDUCER_RANK", "1")
    monkeypatch.setenv("REDUCER_WORLD_SIZE", "3")
    try:
        reducer = rtf.init(wire_dtype="float32")
        assert isinstance(reducer, ReducerClient)
        assert (rtf.rank(), rtf.size(), reducer.wire_dtype) == (1, 3, "float32")
        assert rtf.init() is reducer  # init() again keeps the client
        other = rtf.init(addresses=["127.0.0.1:2"], rank=0, world_size=1)
        assert other is not reducer and rtf.client() is other and other.job == "default"
    finally:
        rtf.shutdown()
