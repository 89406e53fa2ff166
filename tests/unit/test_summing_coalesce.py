"""A summing thread sums a chunk's queued copy and adds, and its finish if
it follows them, in one pass (reducerd/core/_sumpool_threads.c: take_adds,
run_pass).

The pool's one thread is held by a Python task while the test queues two
chunks' tasks interleaved; then each chunk's copy, adds and finish must run
as one pass (the pool counts them), give the bits of the same tasks run one
by one (float32, in rank order, MEAN's division in float32, checked against
NumPy), and run in their chunk's order: never past the chunk's finish, nor
past a Python task, which may read the accumulator. An int8 message (all
its block scales, then its codes) is cut where its blocks divide the pass's
4,096 elements, else summed task by task; its finish runs alone.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from reducer_wire import convert, quant
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core.summing_c import ADD, COPY, CSummingPool, _sumpool

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(_sumpool is None, reason="reducerd.core._sumpool not built")]

WAIT_S = 10.0
DTYPES = [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_INT8_BLOCK128,
          pb.DTYPE_FP8_E4M3, pb.DTYPE_FP8_E5M2]
NUMEL = 3 * 4096 + 123  # three whole pieces of a pass and a partial one (a partial int8 block)
INT8_CODEC = 3  # the C pool's number for int8 (reducerd.core.summing_c._CODECS)


class HeldPool:
    """A one-thread pool whose thread waits in a Python task until release()."""

    def __init__(self, **kwargs) -> None:
        self.pool = CSummingPool(1, **kwargs)
        self.posted: list = []
        self.pool.start(lambda fn, *args: self.posted.append((fn, args)))
        self._entered, self._gate = threading.Event(), threading.Event()
        self.pool.submit(0, lambda scratch: (self._entered.set(), self._gate.wait(WAIT_S)))
        assert self._entered.wait(WAIT_S), "the pool's thread never took the holding task"

    def release_and_run(self) -> None:
        self._gate.set()
        while True:
            assert self.pool.wait_idle(WAIT_S), "summing pool still busy"
            if not self.posted:
                return
            while self.posted:
                fn, args = self.posted.pop(0)
                fn(*args)

    def close(self) -> None:
        self._gate.set()
        assert self.pool.close(WAIT_S)


def contributions(dtype: int, world: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for rank in range(world):
        values = rng.standard_normal(NUMEL).astype(np.float32) * 10
        values[::97] *= 1e3
        values[400:420] = np.float32(1e-40) * (rank + 1)  # float32 subnormals
        out.append(convert.to_wire(values, dtype).tobytes())
    return out


def sequential_sum(dtype: int, wires: list[bytes], divisor: int = 0) -> bytes:
    """The finish's bytes of the sum task by task: widen, add in order, in
    float32, divide by `divisor` (MEAN; 0: SUM) and narrow."""
    acc, widened = np.empty(NUMEL, np.float32), np.empty(NUMEL, np.float32)
    convert.from_wire(wires[0], dtype, acc)
    for wire in wires[1:]:
        convert.from_wire(wire, dtype, widened)
        acc += widened
    if divisor:
        acc /= np.float32(divisor)
    return convert.to_wire(acc, dtype).tobytes()


def queue_two_chunks(pool: CSummingPool, dtype: int, chunks: dict[str, list[bytes]],
                     order: list, divisor: int = 0) -> dict[str, bytearray]:
    """Each chunk's copy, then their adds rank by rank, interleaved, then the
    finishes; every done records (chunk, step) in `order`."""
    accs = {name: pool.new_accumulator(NUMEL) for name in chunks}
    payloads = {name: bytearray(len(wires[0])) for name, wires in chunks.items()}
    world = len(next(iter(chunks.values())))
    for rank in range(world):
        for name, wires in chunks.items():
            pool.submit_sum(0, COPY if rank == 0 else ADD, accs[name], wires[rank], dtype,
                            (order.append, (name, rank)))
    for name in chunks:
        pool.submit_finish(0, accs[name], payloads[name], dtype, divisor,
                           (order.append, (name, "f")))
    return payloads


@pytest.mark.parametrize("divisor", [0, 5], ids=["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: pb.DType.Name(d))
def test_a_chunks_queued_adds_run_in_one_pass_with_the_bits_of_one_by_one(dtype, divisor):
    world = 5
    chunks = {"a": contributions(dtype, world, 1), "b": contributions(dtype, world, 2)}
    results = {}
    for coalesce in (16, 1):
        held = HeldPool(coalesce_at_most=coalesce)
        try:
            order: list = []
            payloads = queue_two_chunks(held.pool, dtype, chunks, order, divisor)
            held.release_and_run()
            results[coalesce] = {name: bytes(p) for name, p in payloads.items()}
            # Each chunk's copy, 4 adds and finish (not int8's) in one pass;
            # nothing with coalescing off.
            assert held.pool.summed == 2 * world
            assert held.pool.coalesced == (2 * world if coalesce > 1 else 0)
            joined = coalesce > 1 and dtype != pb.DTYPE_INT8_BLOCK128
            assert held.pool.finished_in_pass == (2 if joined else 0)
            for name in chunks:  # a chunk's tasks finish in the order queued
                assert [s for n, s in order if n == name] == [*range(world), "f"]
        finally:
            held.close()
    for name, wires in chunks.items():
        assert results[16][name] == sequential_sum(dtype, wires, divisor), name
    assert results[16] == results[1]


def test_a_pass_takes_at_most_coalesce_at_most_tasks():
    dtype, world = pb.DTYPE_FLOAT16, 7
    wires = contributions(dtype, world, 3)
    held = HeldPool(coalesce_at_most=3)
    try:
        order: list = []
        payloads = queue_two_chunks(held.pool, dtype, {"a": wires}, order)
        held.release_and_run()
        # Passes of 3 adds, 3 adds, then the last add with the finish.
        assert (held.pool.coalesced, held.pool.finished_in_pass) == (7, 1)
        assert bytes(payloads["a"]) == sequential_sum(dtype, wires)
    finally:
        held.close()
    with pytest.raises(ValueError, match="coalesce_at_most must be within"):
        CSummingPool(1, coalesce_at_most=0)


@pytest.mark.parametrize("block, cut", [(128, True), (256, True), (96, False)])
def test_an_int8_message_is_cut_only_where_its_blocks_divide_the_pass(block, cut):
    world = 4
    rng = np.random.default_rng(block)
    values = [rng.standard_normal(NUMEL).astype(np.float32) * 10 for _ in range(world)]
    wires = []
    for v in values:
        wire = bytearray(quant.int8_nbytes(NUMEL, block))
        quant.encode_int8(v, wire, block)
        wires.append(bytes(wire))
    expected, widened = np.empty(NUMEL, np.float32), np.empty(NUMEL, np.float32)
    quant.decode_int8(wires[0], expected, block)
    for wire in wires[1:]:
        quant.decode_int8(wire, widened, block)
        expected += widened
    held = HeldPool()
    try:
        acc = held.pool.new_accumulator(NUMEL)
        for rank, wire in enumerate(wires):  # the raw pool: any block size
            held.pool._c.submit_sum(0, COPY if rank == 0 else ADD, acc, wire, INT8_CODEC,
                                    block, len(wire), (len, ()))
        held.release_and_run()
        assert np.array_equal(np.frombuffer(acc, np.float32), expected)
        assert (held.pool.summed, held.pool.coalesced) == (world, world if cut else 0)
    finally:
        held.close()


def test_a_pass_never_takes_an_add_past_its_chunks_finish_or_a_python_task():
    dtype = pb.DTYPE_FLOAT16
    ones = convert.to_wire(np.ones(NUMEL, np.float32), dtype).tobytes()
    held = HeldPool()
    pool = held.pool
    try:
        seen: list = []
        acc = pool.new_accumulator(NUMEL)
        payload = bytearray(len(ones))
        pool.submit_sum(0, COPY, acc, ones, dtype, (len, ()))
        pool.submit_sum(0, ADD, acc, ones, dtype, (len, ()))
        # A Python task between the adds sees the sum so far: 2, not 3.
        pool.submit(0, lambda scratch: seen.append(np.frombuffer(acc, np.float32).copy()))
        pool.submit_sum(0, ADD, acc, ones, dtype, (len, ()))
        pool.submit_finish(0, acc, payload, dtype, 0, (len, ()))
        # An add queued after the finish finds the memory given back: no effect
        # (the finish ends the pass it joins).
        pool.submit_sum(0, ADD, acc, ones, dtype, (len, ()))
        held.release_and_run()
        (snapshot,) = seen
        assert np.all(snapshot == 2.0)
        assert np.all(np.frombuffer(payload, np.float16) == 3.0)
        assert not acc.held
        # Passes: the copy and an add (up to the Python task); the second add
        # and the finish; the add after it alone.
        assert (pool.summed, pool.coalesced, pool.finished_in_pass) == (4, 3, 1)
    finally:
        held.close()
