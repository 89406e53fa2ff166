"""Node-local aggregation: the workers of one host reduce together, then send once.

With L workers on a node, each writes its gradient (as float32) into a shared
memory segment; local rank l sums slice l of all L rows in float32 (small
tensors are cut into fewer slices, topology.node_slice) and sends that
slice to the daemons as the node's contribution (rank = node index,
world_size = number of nodes), receives the reduced slice into the segment,
and every local worker reads the whole result. The node's link carries the
model once each way instead of L times. Barriers and liveness go through the
node coordinator (coordinator.py) hosted by local rank 0; names and cleanup are
in shm.py.

Numerics (stated once, here): inputs enter the segment as float32 (exact for
float16/float32, one rounding for float64). The node sum adds the L rows in
local-rank order in float32. SUM sends the node sum; MEAN sends the node mean
(node sum / L in float32, exact when L is a power of two) with op MEAN, so the
daemons divide the sum of the N node means by N: (1/N) sum_n (1/L) sum_l x =
(1/W) sum x, the mean over all W = N L workers. Dividing before the wire keeps
the values at gradient magnitude: summing first and scaling after would send,
and reduce in float16, sums up to W times larger (overflow at 65504). The
result comes back in the wire dtype and is widened exactly into float32 in the
segment; each worker converts it to its own dtype as the flat path does.
Compared with the flat path a value goes through L-1 + N-1 float32 additions
(and one more division for MEAN) instead of W-1, and is rounded to the wire
dtype once per node instead of once per worker: the same error bound holds
since L + N - 1 <= L N.

Broadcast: every worker but the root writes -0.0 (x + -0.0 == x exactly), so
the root's node sends the root's values and every other node sends -0.0.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Protocol

import grpc
import numpy as np
from reducer_wire import dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.framing import shutdown_quietly

from reducer_client.errors import ReducerError
from reducer_client.node.connect import connect
from reducer_client.node.coordinator import Coordinator, encode
from reducer_client.node.residues import SliceResidues
from reducer_client.node.settle import Settler
from reducer_client.node.shm import (
    attach_segment,
    close_segment,
    segment_prefix,
    sweep_segments,
)
from reducer_client.node.topology import NodeTopology, node_slice

__all__ = ["NodeGroup", "SliceSender"]

# A node op gives up this long after its own deadline if nobody told it why
# (the coordinator and the daemon phase report first, with their reasons).
_BACKSTOP_GRACE_S = 1.0


class SliceSender(Protocol):
    """Send a node's slice to the daemons; the result lands in out[start:start+n]."""

    def __call__(self, values: np.ndarray, start: int, out: np.ndarray, key: str,
                 round_: int, dtype: int, op: int) -> Any: ...  # an object with .future, .fail


class _NodeOp:
    """One node-local reduction as this worker sees it; settled exactly once."""

    def __init__(self, key: str, round_: int, numel: int, shape: tuple[int, ...],
                 out_dtype: np.dtype, dtype: int, op: int, deadline_s: float,
                 out: np.ndarray | None = None) -> None:
        self.key, self.round, self.numel, self.shape = key, round_, numel, shape
        self.out, self.out_dtype, self.dtype, self.op = out, out_dtype, dtype, op
        self.deadline_s = deadline_s
        self.future: Future[np.ndarray] = Future()
        self.future.set_running_or_notify_cancel()
        self.ready = threading.Event()  # the coordinator answered the join
        self.segment: SharedMemory | None = None
        self.phase = "join"  # join -> inputs -> slices -> result
        self.inner: Any = None  # the daemon phase of our slice
        self.settled = False

    def rows(self, local_size: int) -> np.ndarray:
        """The segment as float32 rows: L inputs, then the node sums, then the result.

        np.frombuffer, not np.ndarray(buffer=): the rows must hold the segment's
        buffer exported, so that closing the segment (the client closed, the
        op failed) cannot unmap it under a thread still reading them (close
        then raises BufferError, and the mapping goes with the last view)."""
        assert self.segment is not None and self.segment.buf is not None
        rows = local_size + 2
        return np.frombuffer(self.segment.buf, np.float32, rows * self.numel).reshape(
            rows, self.numel)


class NodeGroup:
    """This worker's part in its node's aggregation (local rank 0 also coordinates)."""

    def __init__(self, job: str, topology: NodeTopology, timeout_s: float,
                 send_slice: SliceSender, incarnation: int = 0) -> None:
        self.job, self.topology, self.timeout_s = job, topology, timeout_s
        self._send_slice, self.residues = send_slice, SliceResidues()  # 8-bit feedback
        self._prefix = segment_prefix(job, topology.node)
        self._coordinator = (Coordinator(job, topology.node, topology.local_size,
                                         topology.nodes, timeout_s, incarnation)
                             if topology.local_rank == 0 else None)
        # _lock guards _ops, _segments and _dead (caller threads, the reader
        # thread, the link threads finishing a slice, the client's watchdog).
        self._lock = threading.Lock()
        self._ops: dict[tuple[str, int], _NodeOp] = {}
        self._segments: dict[str, SharedMemory] = {}
        self._dead: ReducerError | None = None
        # _send_lock serializes writes to the coordinator socket (any thread).
        self._send_lock = threading.Lock()
        try:
            self._sock, self.incarnation = connect(job, topology, timeout_s)
        except BaseException:
            if self._coordinator is not None:
                self._coordinator.close()
            raise
        # Slice sums and result copies run here, off the reader; the callers'
        # callbacks run on the settler's threads, so one that starts another
        # reduction and waits for it blocks neither (settle.py).
        self._work = ThreadPoolExecutor(1, thread_name_prefix="reducer-node")
        self._settler = Settler("reducer-node-settle")
        self._closing = False
        threading.Thread(target=self._read, daemon=True, name="reducer-node-reader").start()
        _groups.add(self)

    # -- public -------------------------------------------------------------

    def reduce(self, flat: np.ndarray | None, shape: tuple[int, ...], out_dtype: np.dtype,
               key: str, round_: int, dtype: int, op: int, root_rank: int | None,
               out: np.ndarray | None = None) -> Future[np.ndarray]:
        """Reduce over the node, then over the nodes; flat=None contributes -0.0.
        The result goes into `out` when given (checked by the client), else a new array.

        Blocks for one message round trip to the coordinator (it names the
        segment), writes the input there and returns: the input is copied.
        """
        numel = int(np.prod(shape, dtype=np.int64))
        node_op = _NodeOp(key, round_, numel, shape, out_dtype, dtype, op,
                          time.monotonic() + self.timeout_s, out)
        if numel == 0:
            node_op.future.set_result(np.empty(shape, dtype=out_dtype) if out is None else out)
            return node_op.future
        with self._lock:
            dead = self._dead
            if dead is None:
                self._ops[(key, round_)] = node_op
        if dead is not None:
            node_op.future.set_exception(dead)
            return node_op.future
        self._send(["join", key, round_, [numel, dtype, op, root_rank]])
        if not node_op.ready.wait(self.timeout_s + _BACKSTOP_GRACE_S):
            self._fail(node_op, self._late(node_op), tell=True)
        if node_op.segment is None or node_op.settled:
            return node_op.future  # failed (mismatch, no /dev/shm, node aborted)
        rows = node_op.rows(self.topology.local_size)
        row = rows[self.topology.local_rank]
        if flat is None:
            row.fill(-0.0)
        else:
            np.copyto(row, flat, casting="unsafe")  # float64 rounds to float32 here
        del rows, row
        node_op.phase = "inputs"
        self._send(["wrote", key, round_])
        return node_op.future

    def check_deadlines(self, now: float) -> None:
        """Backstop for the client's watchdog: fail what nobody answered in time."""
        with self._lock:
            late = [op for op in self._ops.values()
                    if op.deadline_s + _BACKSTOP_GRACE_S <= now and op.phase != "result"]
        for node_op in late:
            self._fail(node_op, self._late(node_op), tell=True)

    def close(self) -> None:
        """Fail what is open, leave the node (local rank 0: stop coordinating)."""
        self._closing = True
        _groups.discard(self)
        self._abort(ReducerError(grpc.StatusCode.CANCELLED, "client closed"), sweep=False)
        self._send(["bye"])
        shutdown_quietly(self._sock)
        self._sock.close()
        if self._coordinator is not None:
            self._coordinator.close()
        self._work.shutdown(wait=False)
        self._settler.close()
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        if self._coordinator is None:
            for shm in segments:
                close_segment(shm)

    # -- coordinator connection ----------------------------------------------

    def _send(self, message: list[Any]) -> None:
        with self._send_lock:
            try:
                self._sock.sendall(encode(message))
            except OSError:
                pass  # the reader sees the connection end and fails what is open

    def _read(self) -> None:
        reader = self._sock.makefile("rb")
        try:
            for line in reader:
                self._dispatch(json.loads(line))
        except (OSError, ValueError):
            pass
        self._abort(ReducerError(
            grpc.StatusCode.ABORTED,
            f"node-local aggregation, job {self.job!r} node {self.topology.node}: lost the "
            "node's coordinator (local rank 0 exited or was killed)"), sweep=not self._closing)

    def _dispatch(self, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == "abort":
            self._abort(ReducerError(grpc.StatusCode.ABORTED, msg[1]), sweep=True)
            return
        if kind == "forget":  # a failed op's segment, which nobody uses any more
            with self._lock:
                shm = self._segments.pop(msg[1], None)
            if shm is not None and self._coordinator is None:  # rank 0's is the coordinator's
                close_segment(shm)
            return
        with self._lock:
            node_op = self._ops.get((msg[1], msg[2]))
            if node_op is not None and kind == "result":
                node_op.phase = "result"  # from here on nothing can fail it
        if node_op is None:
            return
        if kind == "seg" and not str(msg[3]).startswith(self._prefix):
            # Only this job's and node's segments: whoever named it is not our coordinator.
            self._fail(node_op, ReducerError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"job {self.job!r} key {msg[1]!r} round {msg[2]}: the node's socket named "
                f"segment {msg[3]!r}, not this job's and node's ({self._prefix}...): "
                "not attached"), tell=False)
        elif kind == "seg":
            node_op.segment = self._segment(msg[3])
            node_op.ready.set()
        elif kind == "fail":
            code = getattr(grpc.StatusCode, msg[3], grpc.StatusCode.UNKNOWN)
            self._fail(node_op, ReducerError(code, msg[4]), tell=False)
        elif kind == "go":
            node_op.phase = "slices"
            self._work.submit(self._reduce_slice, node_op)
        elif kind == "result":
            self._work.submit(self._finish, node_op)

    def _segment(self, name: str) -> SharedMemory:
        with self._lock:
            shm = self._segments.get(name)
            if shm is None:
                shm = (self._coordinator.segment(name) if self._coordinator is not None
                       else attach_segment(name))
                self._segments[name] = shm
        return shm

    # -- the phases -----------------------------------------------------------

    def _reduce_slice(self, node_op: _NodeOp) -> None:
        """Sum our slice of the L rows in float32 and send it to the daemons."""
        if node_op.settled:
            return  # failed while queued: its release follows on this thread
        topo = self.topology
        wire_bytes = dtypes.wire_nbytes(node_op.dtype, node_op.numel)  # int8: scales too
        start, stop = node_slice(node_op.numel, max(1, wire_bytes // max(node_op.numel, 1)),
                                 topo.local_size, topo.local_rank)
        if start == stop:
            self._send(["done", node_op.key, node_op.round])
            return
        local_size = topo.local_size
        rows = node_op.rows(local_size)
        # Sum into the segment's row of node sums: not into the result row,
        # where replies land while later chunks of the slice may still be read
        # for sending; not into a fresh buffer, which costs page faults per step.
        acc, result = rows[local_size, start:stop], rows[local_size + 1]
        # local_size >= 2 here (no node group otherwise); fixed order: same bits every step
        np.add(rows[0, start:stop], rows[1, start:stop], out=acc)
        for local_rank in range(2, local_size):
            np.add(acc, rows[local_rank, start:stop], out=acc)
        if node_op.op == pb.REDUCE_OP_MEAN:
            # Node mean: the daemons average the N node means (see module docstring).
            np.divide(acc, np.float32(local_size), out=acc)
        self.residues.apply(node_op.key, node_op.dtype, acc)  # if the shim asked
        del rows
        inner = self._send_slice(acc, start, result, node_op.key, node_op.round,
                                 node_op.dtype, node_op.op)
        node_op.inner = inner
        if node_op.settled:  # failed meanwhile, after _fail looked for it
            inner.fail(ReducerError(grpc.StatusCode.CANCELLED, "node operation failed"))
        inner.future.add_done_callback(lambda f: self._slice_sent(node_op, f))

    def _slice_sent(self, node_op: _NodeOp, future: Future) -> None:
        error = future.exception()
        if error is None:
            self._send(["done", node_op.key, node_op.round])
        elif not node_op.settled:
            self._send(["fail", node_op.key, node_op.round, error.code.name
                        if isinstance(error, ReducerError) else "INTERNAL", str(error)])

    def _finish(self, node_op: _NodeOp) -> None:
        """Copy the whole result out of the segment, free it, complete the future."""
        result = node_op.rows(self.topology.local_size)[-1]
        out = (np.empty(node_op.shape, dtype=node_op.out_dtype) if node_op.out is None
               else node_op.out)
        # exact: float32 holds the wire value
        np.copyto(out.reshape(-1), result, casting="unsafe")
        del result
        with self._lock:
            if node_op.settled:
                return
            node_op.settled = True
            self._ops.pop((node_op.key, node_op.round), None)
        self._send(["release", node_op.key, node_op.round])
        self._settler.submit(node_op.future.set_result, out)

    def _fail(self, node_op: _NodeOp, error: ReducerError, tell: bool) -> None:
        """Settle with an error; tell=True also fails the op for the other local ranks."""
        with self._lock:
            if node_op.settled:
                return
            node_op.settled = True
            self._ops.pop((node_op.key, node_op.round), None)
        node_op.ready.set()
        if node_op.inner is not None:  # stop waiting for the daemons
            node_op.inner.fail(error)
        if tell:
            self._send(["fail", node_op.key, node_op.round, error.code.name, str(error)])
        # Released on the work thread, after the op's queued slice work, which
        # then sees it failed: once all released, the segment is unmapped.
        release = ["release", node_op.key, node_op.round]
        try:
            self._work.submit(self._send, release)
        except RuntimeError:  # shut down (closing)
            self._send(release)
        self._settler.submit(node_op.future.set_exception, error)

    def _late(self, node_op: _NodeOp) -> ReducerError:
        waiting = {"join": "the node's coordinator", "inputs": "the other local workers",
                   "slices": "the node's slices (local workers and daemons)"}
        return ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"job {self.job!r} key {node_op.key!r} round {node_op.round} "
                            f"(node {self.topology.node}, local rank "
                            f"{self.topology.local_rank}): no result within "
                            f"{self.timeout_s:g} s, waiting for "
                            f"{waiting.get(node_op.phase, node_op.phase)}")

    def _abort(self, error: ReducerError, sweep: bool) -> None:
        """The node is gone (a worker died, or we close): fail every open op."""
        with self._lock:
            if self._dead is None:
                self._dead = error
            failing = [op for op in self._ops.values() if op.phase != "result"]
        for node_op in failing:
            self._fail(node_op, error, tell=False)
        if sweep:  # whatever is still named in /dev/shm would outlive us
            sweep_segments(self._prefix)


# Live groups of this process, for the fork handler below.
_groups: weakref.WeakSet[NodeGroup] = weakref.WeakSet()


def _drop_fds_in_child() -> None:
    """A forked child (a DataLoader worker, say) must not keep our sockets open:
    the others detect a dead worker by its socket closing."""
    for group in list(_groups):
        # close() would leave the descriptor open: the reader's makefile() holds it.
        os.close(group._sock.detach())
        if group._coordinator is not None:
            group._coordinator.drop_fds_in_child()
    _groups.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_fds_in_child)
