"""An in-process daemon behind the transport seam: link tests without sockets.

    daemon = FakeDaemon(round_timeout_s=60)
    link = DaemonLink("fake:1", control=daemon,
                      transports=[daemon.transport("tcp"), daemon.transport("grpc")])

Like reducerd it sums each chunk (job, key, round, offset) in float32 (MEAN
divides by world_size before the one rounding), answers every contributor's
stream, counts a rank once, keeps a chunk's last result until its next round
completes or a round timeout passes and answers a resent contribution from
that cache, and ends a half-closed stream once it owes it nothing.

Faults, for tests: drop_streams() breaks every open stream (open chunks stay,
as on a real daemon whose connections broke); restart() also loses every open
chunk and, unless keep_results, the results cache (a real restart loses
both); refuse(code, details, times) fails the next stream opens (times=None:
until heal()); down makes the brief status and every open fail UNAVAILABLE;
reachable(name, False) makes a transport raise NotOffered; delay_s (per
transport, or the daemon's) holds each reply; fail_key(key, code, message)
answers that key's chunks with an in-band error. `received` lists every
contribution that arrived, `opens` every attempt to open a stream.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
import numpy as np
from reducer_wire import convert, dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardView, decode_shard, encode_shard

from reducer_client.transport.base import (
    HEADROOM,
    Control,
    DaemonInfo,
    NotOffered,
    Transport,
    TransportError,
)

__all__ = ["FakeDaemon", "Received"]

ChunkId = tuple[str, str, int, int]  # job, key, round, offset


class Received(NamedTuple):
    """One contribution as the fake daemon got it."""

    stream: int
    transport: str
    key: str
    round: int
    offset: int
    rank: int


@dataclass
class _Open:
    acc: np.ndarray
    dtype: int
    op: int
    world_size: int
    ranks: set[int] = field(default_factory=set)
    streams: list[_FakeStream] = field(default_factory=list)


class _Result(NamedTuple):
    round: int
    reply: bytes  # the encoded reply Shard
    expires_s: float


class FakeDaemon(Control):
    """Sums in-process; see the module docstring for its fault switches."""

    def __init__(self, round_timeout_s: float | None = 60.0, data_port: int = 1) -> None:
        self.round_timeout_s = round_timeout_s
        self.data_port = data_port
        self.delay_s = 0.0
        self.down = False
        # _lock guards everything below and each stream's state: taken by the
        # links' reader threads (opens), the streams' taker threads, the test.
        self._lock = threading.Lock()
        self._open: dict[ChunkId, _Open] = {}
        # (job, key, offset) -> round -> result. As in reducerd, a round's
        # completion drops the older rounds' results, not the newer ones: a
        # stale resend that completes an old round again (two ranks' histories
        # after a break) must not hide the result a newer round's resend needs.
        self._results: dict[tuple[str, str, int], dict[int, _Result]] = {}
        self._streams: set[_FakeStream] = set()
        self._refusal: tuple[grpc.StatusCode, str, int | None] | None = None
        self._unreachable: set[str] = set()
        self._failing: dict[str, tuple[grpc.StatusCode, str]] = {}
        self.received: list[Received] = []
        self.opens: list[str] = []  # transport name of every open attempt
        self.status_calls = 0

    # -- the seam --------------------------------------------------------------

    def brief_status(self) -> DaemonInfo:
        with self._lock:
            self.status_calls += 1
            if self.down:
                raise TransportError(grpc.StatusCode.UNAVAILABLE, "fake daemon is down")
            return DaemonInfo(self.data_port, self.round_timeout_s)

    def transport(self, name: str = "fake", delay_s: float | None = None) -> Transport:
        """A transport to this daemon called `name`, its replies held delay_s
        (default: the daemon's delay_s)."""
        return _FakeTransport(self, name, delay_s)

    # -- faults ----------------------------------------------------------------

    def drop_streams(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                     details: str = "fake stream dropped") -> int:
        """Break every open stream; the number broken."""
        with self._lock:
            streams, self._streams = list(self._streams), set()
            for stream in streams:
                stream.broken = TransportError(code, details)
                stream.replies.put(None)  # wake its reader
        return len(streams)

    def restart(self, keep_results: bool = False) -> None:
        """Break every stream and forget every open chunk (and the results)."""
        self.drop_streams(grpc.StatusCode.UNAVAILABLE, "fake daemon restarted")
        with self._lock:
            self._open.clear()
            if not keep_results:
                self._results.clear()

    def refuse(self, code: grpc.StatusCode, details: str, times: int | None = 1) -> None:
        with self._lock:
            self._refusal = (code, details, times)

    def heal(self) -> None:
        """Undo refuse(), down and every reachable(name, False)."""
        with self._lock:
            self._refusal, self.down = None, False
            self._unreachable.clear()

    def reachable(self, name: str, reachable: bool) -> None:
        with self._lock:
            (self._unreachable.discard if reachable else self._unreachable.add)(name)

    def fail_key(self, key: str, code: grpc.StatusCode, message: str) -> None:
        with self._lock:
            self._failing[key] = (code, message)

    def contributions(self, key: str, rank: int | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.key == key and rank in (None, r.rank)]

    # -- internals ---------------------------------------------------------------

    def _open_stream(self, transport: _FakeTransport, requests: Iterator[memoryview],
                     ) -> _FakeStream:
        with self._lock:
            self.opens.append(transport.name)
            if self.down:
                raise TransportError(grpc.StatusCode.UNAVAILABLE, "fake daemon is down")
            if transport.name in self._unreachable:
                raise NotOffered(grpc.StatusCode.UNAVAILABLE,
                                 f"fake {transport.name} is unreachable")
            if self._refusal is not None:
                code, details, times = self._refusal
                if times is not None:
                    self._refusal = (code, details, times - 1) if times > 1 else None
                raise TransportError(code, details)
            delay_s = self.delay_s if transport.delay_s is None else transport.delay_s
            stream = _FakeStream(self, len(self.opens), transport.name, delay_s)
            self._streams.add(stream)
            transport.streams.add(stream)
        threading.Thread(target=stream.take, args=(requests,), daemon=True,
                         name=f"fake-daemon-stream-{stream.ident}").start()
        return stream

    def _contribute(self, stream: _FakeStream, shard: ShardView) -> None:
        with self._lock:
            if stream.broken is not None:
                return
            self.received.append(Received(stream.ident, stream.transport, shard.key,
                                          shard.round, shard.offset, shard.rank))
            failing = self._failing.get(shard.key)
            if failing is not None:
                stream.reply(encode_shard(job=shard.job, key=shard.key, round=shard.round,
                                          offset=shard.offset, dtype=shard.dtype, op=shard.op,
                                          error_code=failing[0].value[0],
                                          error_message=failing[1]))
                return
            now = time.monotonic()
            slot = (shard.job, shard.key, shard.offset)
            rounds = self._results.get(slot, {})
            cached = rounds.get(shard.round)
            if cached is not None and cached.expires_s <= now:
                del rounds[shard.round]
            elif cached is not None:
                stream.reply(cached.reply)  # a resend: the cached result, not counted
                return
            cid = (shard.job, shard.key, shard.round, shard.offset)
            chunk = self._open.get(cid)
            if chunk is None:
                numel = dtypes.wire_numel(shard.dtype, len(shard.data)) or 0
                chunk = self._open[cid] = _Open(np.zeros(numel, np.float32), shard.dtype,
                                                shard.op, shard.world_size)
            chunk.streams.append(stream)
            stream.waiting.add(cid)
            if shard.rank in chunk.ranks:
                return  # a retry: counted once, this stream waits too
            widened = np.empty_like(chunk.acc)
            convert.from_wire(shard.data, shard.dtype, widened)
            chunk.acc += widened
            chunk.ranks.add(shard.rank)
            if len(chunk.ranks) < chunk.world_size:
                return
            del self._open[cid]
            if chunk.op == pb.REDUCE_OP_MEAN:
                chunk.acc /= np.float32(chunk.world_size)
            reply = encode_shard(job=shard.job, key=shard.key, round=shard.round,
                                 offset=shard.offset, dtype=chunk.dtype, op=chunk.op,
                                 world_size=chunk.world_size,
                                 data=convert.to_wire(chunk.acc, chunk.dtype).tobytes())
            if self.round_timeout_s is not None:
                rounds = self._results.setdefault(slot, {})
                for older in [r for r in rounds if r < shard.round]:
                    del rounds[older]
                rounds[shard.round] = _Result(shard.round, reply, now + self.round_timeout_s)
            for waiting in chunk.streams:
                waiting.waiting.discard(cid)
                if waiting.broken is None:
                    waiting.reply(reply)
                    waiting.maybe_end()


class _FakeTransport(Transport):
    def __init__(self, daemon: FakeDaemon, name: str, delay_s: float | None) -> None:
        self.daemon, self.name, self.label, self.delay_s = daemon, name, f"fake {name}", delay_s
        self.streams: set[_FakeStream] = set()

    def open(self, requests: Iterator[memoryview], daemon: DaemonInfo,
             ) -> Iterable[ShardView]:
        return self.daemon._open_stream(self, requests)

    def close(self) -> None:
        with self.daemon._lock:
            for stream in self.streams:
                if stream.broken is None:
                    stream.broken = TransportError(grpc.StatusCode.CANCELLED, "channel closed")
                    stream.replies.put(None)


class _FakeStream:
    """One stream: a taker thread reads the requests, the link iterates replies."""

    def __init__(self, daemon: FakeDaemon, ident: int, transport: str, delay_s: float) -> None:
        self.daemon, self.ident, self.transport, self.delay_s = daemon, ident, transport, delay_s
        # The daemon's lock guards waiting, half_closed and broken.
        self.waiting: set[ChunkId] = set()
        self.half_closed = False
        self.broken: TransportError | None = None
        # (due time, reply Shard bytes), or None: look at `broken`, or the end.
        self.replies: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()

    def take(self, requests: Iterator[memoryview]) -> None:
        for item in requests:
            # A copy: the link may reuse the buffer once the next item is asked for.
            self.daemon._contribute(self, decode_shard(bytes(item[HEADROOM:])))
            if self.broken is not None:
                return  # like a dead socket: nothing more is read
        with self.daemon._lock:
            self.half_closed = True
            self.maybe_end()

    def reply(self, message: bytes) -> None:
        """Queue a reply (daemon lock held)."""
        self.replies.put((time.monotonic() + self.delay_s, message))

    def maybe_end(self) -> None:
        """After the half-close, once nothing is owed: end with OK (lock held)."""
        if self.half_closed and not self.waiting and self.broken is None:
            self.replies.put(None)

    def __iter__(self) -> Iterator[ShardView]:
        while True:
            item = self.replies.get()
            if item is not None:
                wait_s = item[0] - time.monotonic()
                if wait_s > 0:
                    time.sleep(wait_s)
            with self.daemon._lock:
                broken = self.broken
            if item is None and broken is None:
                return  # half-closed and answered: ended with OK
            if broken is not None:
                raise broken
            assert item is not None
            yield decode_shard(item[1])
