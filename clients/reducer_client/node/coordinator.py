"""The node coordinator: barriers, segment pool and liveness for one node's workers.

Local rank 0 runs it on a thread; every local worker (rank 0 included) talks to
it over a Unix stream socket, one JSON message per line. The data never
crosses the socket, only these messages (worker -> coordinator):

    ["hello", local_rank, local_size, nodes]   -> ["welcome", incarnation], ["abort", why]
                               or, if this coordinator is going away, ["retry", why]
    ["join", key, round, signature]            -> ["seg", key, round, name] or ["fail", ...]
    ["wrote", key, round]      input written;  all wrote -> ["go", key, round] to all
    ["done", key, round]       slice reduced;  all done  -> ["result", key, round] to all
    ["fail", key, round, code, why]            -> ["fail", key, round, code, why] to all
    ["release", key, round]    finished with the op; all released -> segment reused,
                               or, if the op failed, ["forget", name] to all: unmapped
    ["bye"]

Liveness: a worker that dies closes its socket (the kernel does it, even on
SIGKILL), and the coordinator tells every other worker ["abort", why] at once,
so nobody waits at a barrier for a dead process. A worker whose coordinator
dies sees its own socket close. Nothing here polls except the 0.2 s tick that
expires operations some local worker never reached.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import grpc

from reducer_client.errors import ReducerError
from reducer_client.node.pool import Segment, SegmentPool, unlink_all
from reducer_client.node.shm import (
    segment_prefix,
    socket_address,
    sweep_segments,
    unlink_segment,
)

__all__ = ["Coordinator", "encode", "segment_nbytes"]

_TICK_S = 0.2


def encode(message: list[Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def segment_nbytes(numel: int, local_size: int) -> int:
    """L float32 input rows, a row of node sums and a result row."""
    return (local_size + 2) * numel * 4


@dataclass
class _Op:
    signature: list[Any]
    segment: Segment | None
    started_s: float
    joined: set[int] = field(default_factory=set)
    wrote: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    released: set[int] = field(default_factory=set)
    failed: list[Any] | None = None  # [code name, why]


class Coordinator:
    """Serve one node's local workers; started by local rank 0's client."""

    def __init__(self, job: str, node: int, local_size: int, nodes: int,
                 timeout_s: float, incarnation: int = 0) -> None:
        self.job, self.node, self.local_size, self.nodes = job, node, local_size, nodes
        self.timeout_s = timeout_s
        # The node's Shard.incarnation, which every local worker sends as the node's.
        self.incarnation = incarnation
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = socket_address(job, node)
        try:
            self._listener.bind(address)
        except OSError as exc:
            self._listener.close()
            raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"node-local aggregation: cannot host node {node} of job "
                               f"{job!r} on this host ({exc.strerror}): another local rank 0 "
                               "of this job and node is running") from exc
        self._address = address
        self._listener.listen(local_size + 4)
        # A run of this job that crashed may have left segments behind.
        sweep_segments(segment_prefix(job, node))
        self._pool = SegmentPool(f"{segment_prefix(job, node)}{os.getpid()}-")
        # Everything below is touched by the coordinator thread only, except
        # _segments, which the owner process's worker side reads (segment()):
        # entries are added before their name is sent and removed at close.
        self._segments = self._pool.segments
        self._ops: dict[tuple[str, int], _Op] = {}
        self._peers: dict[socket.socket, dict[str, Any]] = {}
        self._ranks: dict[int, socket.socket] = {}
        self._dead: str | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        # At exit without close() (the serving thread is a daemon thread).
        self._unlink_all = weakref.finalize(self, unlink_all, self._segments)
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"reducer-node{node}-coordinator")
        self._thread.start()

    def segment(self, name: str) -> SharedMemory:
        """The owner's own mapping of a segment (local rank 0 never re-attaches)."""
        return self._segments[name].shm

    def drop_fds_in_child(self) -> None:
        """In a forked child: close our copies of the sockets, or a dead worker's
        end would stay open in its children and nobody would notice it died."""
        for sock in (self._listener, self._wake_r, self._wake_w, *self._peers):
            os.close(sock.detach())
        self._unlink_all.detach()  # the parent owns the segments

    def close(self) -> None:
        """Stop serving, unlink every segment; the workers see their sockets close."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)

    # -- the serving thread -------------------------------------------------

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop:
                for key, _ in selector.select(_TICK_S):
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    elif key.fileobj is not self._wake_r:
                        self._receive(selector, key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            for peer in list(self._peers):
                peer.close()
            selector.close()
            self._listener.close()
            if not self._address.startswith("\0"):
                os.unlink(self._address)
            self._wake_r.close()
            self._wake_w.close()
            self._unlink_all.detach()
            self._pool.close()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        conn, _ = self._listener.accept()
        pid = uid = -1
        if hasattr(socket, "SO_PEERCRED"):
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if uid != os.getuid():  # only this user's processes share our memory
                conn.close()
                return
        self._peers[conn] = {"pid": pid, "rank": None, "buffer": b"", "bye": False}
        selector.register(conn, selectors.EVENT_READ)

    def _receive(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        peer = self._peers[conn]
        try:
            data = conn.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            selector.unregister(conn)
            conn.close()
            del self._peers[conn]
            self._gone(peer)
            return
        peer["buffer"] += data
        *lines, peer["buffer"] = peer["buffer"].split(b"\n")
        for line in lines:
            self._handle(conn, peer, json.loads(line))

    def _gone(self, peer: dict[str, Any]) -> None:
        rank = peer["rank"]
        if rank is None or self._ranks.get(rank) is None:
            return
        del self._ranks[rank]
        how = ("closed its client" if peer["bye"] else
               "disconnected without closing its client: it exited or was killed")
        self._abort(f"node-local aggregation, job {self.job!r} node {self.node}: local rank "
                    f"{rank} (pid {peer['pid']}) {how}")

    def _send(self, conn: socket.socket, message: list[Any]) -> None:
        try:
            conn.sendall(encode(message))
        except OSError:
            pass  # its death shows up as end-of-file on the read side

    def _to_ranks(self, ranks: set[int], message: list[Any]) -> None:
        for rank in sorted(ranks):
            conn = self._ranks.get(rank)
            if conn is not None:
                self._send(conn, message)

    def _handle(self, conn: socket.socket, peer: dict[str, Any], msg: list[Any]) -> None:
        kind = msg[0]
        if kind == "hello":
            self._hello(conn, peer, *msg[1:])
        elif kind == "bye":
            peer["bye"] = True
        elif self._dead is not None:
            self._send(conn, ["abort", self._dead])
        elif kind == "join":
            self._join(peer["rank"], msg[1], msg[2], msg[3])
        elif kind in ("wrote", "done", "release"):
            op = self._ops.get((msg[1], msg[2]))
            if op is not None:
                getattr(self, f"_{kind}")(peer["rank"], (msg[1], msg[2]), op)
        elif kind == "fail":
            op = self._ops.get((msg[1], msg[2]))
            if op is not None:
                self._fail(op, msg[3], f"local rank {peer['rank']}: {msg[4]}")

    def _hello(self, conn: socket.socket, peer: dict[str, Any], local_rank: int,
               local_size: int, nodes: int) -> None:
        where = f"node-local aggregation, job {self.job!r} node {self.node}"
        problem = None
        if (local_size, nodes) != (self.local_size, self.nodes):
            problem = (f"local rank {local_rank} has local_size {local_size} and {nodes} "
                       f"node(s); local rank 0 has {self.local_size} and {self.nodes}")
        elif self._dead is not None or self._leaving(local_rank):
            # Going away (an elastic reset, say): local rank 0 replaces it soon,
            # so the worker retries rather than fail (connect.py).
            self._send(conn, ["retry", self._dead or f"{where}: local rank {local_rank} "
                                                     "is leaving"])
            return
        elif local_rank in self._ranks:
            problem = f"local rank {local_rank} is already connected"
        if problem:
            self._send(conn, ["abort", f"{where}: {problem}"])
            return
        peer["rank"] = local_rank
        self._ranks[local_rank] = conn
        self._send(conn, ["welcome", self.incarnation])

    def _leaving(self, local_rank: int) -> bool:
        """Whether that rank's old connection said bye and has not yet closed."""
        conn = self._ranks.get(local_rank)
        return conn is not None and self._peers[conn]["bye"]

    def _join(self, rank: int, key: str, round_: int, signature: list[Any]) -> None:
        op = self._ops.get((key, round_))
        if op is None:
            op = self._ops[(key, round_)] = _Op(signature, None, time.monotonic())
            self._allocate(key, round_, op)
        op.joined.add(rank)
        if op.failed is None and signature != op.signature:
            fields = ("elements", "wire dtype", "op", "root rank")
            diff = [f"{f} {a} vs {b}" for f, a, b in zip(fields, signature, op.signature,
                                                          strict=True) if a != b]
            self._fail(op, grpc.StatusCode.INVALID_ARGUMENT.name,
                       f"local ranks disagree on key {key!r} round {round_}: local rank "
                       f"{rank} has {', '.join(diff)} (first joiner's values last)")
            return
        if op.failed is not None:
            self._to_ranks({rank}, ["fail", key, round_, *op.failed])
            return
        assert op.segment is not None
        self._to_ranks({rank}, ["seg", key, round_, op.segment.shm.name])

    def _allocate(self, key: str, round_: int, op: _Op) -> None:
        """Give the op a segment (pool.py), or fail it: /dev/shm has no room."""
        need = segment_nbytes(op.signature[0], self.local_size)
        busy = {id(o.segment) for o in self._ops.values() if o is not op}
        got = self._pool.take(need, busy)
        if isinstance(got, str):
            op.failed = [grpc.StatusCode.RESOURCE_EXHAUSTED.name,
                         f"key {key!r} round {round_} {got}"]
        else:
            op.segment = got

    def _wrote(self, rank: int, op_key: tuple[str, int], op: _Op) -> None:
        op.wrote.add(rank)
        if len(op.wrote) == self.local_size and op.failed is None:
            assert op.segment is not None
            if not op.segment.unlinked:  # everyone has it mapped: drop the name
                unlink_segment(op.segment.shm)
                op.segment.unlinked = True
            self._to_ranks(op.joined, ["go", *op_key])

    def _done(self, rank: int, op_key: tuple[str, int], op: _Op) -> None:
        op.done.add(rank)
        if len(op.done) == self.local_size and op.failed is None:
            self._to_ranks(op.joined, ["result", *op_key])

    def _release(self, rank: int, op_key: tuple[str, int], op: _Op) -> None:
        op.released.add(rank)
        if len(op.released) == self.local_size:
            del self._ops[op_key]  # its segment is free again (unless retired)
            if op.failed is not None and op.segment is not None and self._dead is None:
                self._drop(op.segment)

    def _drop(self, segment: Segment) -> None:
        """Give a failed op's segment back: every local rank released the op
        (after its daemon phase settled) and it is never reused (late writes
        may have landed); kept, it would hold its pages for ever."""
        self._to_ranks(set(self._ranks), ["forget", self._pool.drop(segment)])

    def _fail(self, op: _Op, code: str, why: str) -> None:
        if op.failed is not None:
            return
        op.failed = [code, why]
        if op.segment is not None:
            op.segment.retired = True
        key = next(k for k, o in self._ops.items() if o is op)
        self._to_ranks(op.joined, ["fail", *key, code, why])

    def _expire(self, now: float) -> None:
        """Fail ops that some local worker has not reached within the timeout."""
        for (key, round_), op in list(self._ops.items()):
            if (op.failed is None and len(op.wrote) < self.local_size
                    and now - op.started_s > self.timeout_s):
                missing = sorted(set(range(self.local_size)) - op.wrote)
                self._fail(op, grpc.StatusCode.DEADLINE_EXCEEDED.name,
                           f"node-local aggregation, job {self.job!r} node {self.node}: "
                           f"local rank(s) {missing} did not reach key {key!r} round "
                           f"{round_} within {self.timeout_s:g} s")

    def _abort(self, why: str) -> None:
        """The node lost a worker: fail everything, now and later; drop every name."""
        if self._dead is not None:
            return
        self._dead = why
        for op in self._ops.values():
            op.failed = op.failed or [grpc.StatusCode.ABORTED.name, why]
        self._to_ranks(set(self._ranks), ["abort", why])
        for segment in self._segments.values():
            segment.retired = True
        unlink_all(self._segments)

