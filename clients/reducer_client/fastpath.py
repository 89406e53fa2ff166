"""Whole keys through the C loop (_tcploop.c): no Python per chunk.

Where a client's daemon links run the TCP data plane without TLS, a key's
chunks go to a C thread at once: encode() narrows every chunk into its frame
before allreduce_async returns, the loop sends them under SendOrder's window
and credits (order.py) and LinkQueue's priorities, matches the replies,
checks their dtype and length and widens them into the output; Python hears
of a key once (done, or its first error).

One connection per daemon: the loop's connection is the link's own stream
(transport/loopstream.py). The link dials it, with its refusals, backoff and
fallback to gRPC, and sends through it what the loop does not carry (float64
and integer arrays, resends, keys sent while a connection was down); replies
that are no loop key's go back to the link. A key takes the loop only while
every link's stream is on it.

The rare paths stay in Python: when a daemon's connection ends, its
unanswered chunks and the contributions to the last completed round of each
key on it (what a restarted daemon may need, as history.py keeps them) go to
that daemon's DaemonLink before its stream ends, so it resends or fails them
with its own backoff, retries and errors, exactly as after a break on the
Python path. An in-band error, a reply of the wrong size or dtype fail the
key with the Python path's errors.

Off where the extension was not built, with REDUCER_WIRE_NUMPY=1 (the C
kernels are off) and with REDUCER_CLIENT_C_LOOP=0 (env.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.layout import Chunk
from reducer_wire.quant import INT8_BLOCK

from reducer_client.errors import ReducerError, status_code_from_value
from reducer_client.ops import Operation, reply_dtype_problem
from reducer_client.transport.base import DaemonInfo, TransportError
from reducer_client.transport.history import MAX_SLOTS, Message
from reducer_client.transport.link import DaemonLink
from reducer_client.transport.loopstream import LoopStream, LoopTransport
from reducer_client.transport.order import CREDITS_PER_LINK, MAX_WAIT_S, STALL_S, WINDOW_PER_DAEMON
from reducer_client.transport.tcp import TcpTransport, stream_end_error

try:
    from reducer_client.transport import _tcploop  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: every key takes the Python path
    _tcploop = None

__all__ = ["FastPath", "available"]

log = logging.getLogger("reducer_client")

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))


def _codecs() -> dict[int, tuple[int, int]]:
    """Wire dtype -> (the loop's codec, its parameter), for the kernels built."""
    if _tcploop is None:
        return {}
    table = {pb.DTYPE_FLOAT32: (_tcploop.FLOAT32, 0), pb.DTYPE_FLOAT16: (_tcploop.FLOAT16, 0),
             pb.DTYPE_BFLOAT16: (_tcploop.BFLOAT16, 0),
             pb.DTYPE_INT8_BLOCK128: (_tcploop.INT8, INT8_BLOCK),
             pb.DTYPE_FP8_E4M3: (_tcploop.FP8, 0), pb.DTYPE_FP8_E5M2: (_tcploop.FP8, 1)}
    return {dtype: entry for dtype, entry in table.items() if _tcploop.available(entry[0])}


def plain_tcp(link: DaemonLink) -> TcpTransport | None:
    """The link's TCP data plane where streams try it first, without TLS: what
    the loop can carry; else None."""
    first = link.route()[1]
    if isinstance(first, LoopTransport):
        first = first.tcp
    return first if isinstance(first, TcpTransport) and first.plain else None


def available() -> bool:
    """Whether the C loop was built, with the float16 kernels it needs."""
    return _tcploop is not None and pb.DTYPE_FLOAT16 in _codecs()


class _Flight(NamedTuple):
    operation: Operation
    batch: Any  # _tcploop.Batch


class _Done:
    """A key's last round completed on the loop: what a restarted daemon may
    need (its frames), and the spare batch for its next round."""

    __slots__ = ("round", "batch", "chunks", "completed_s", "spare")

    def __init__(self, round_: int, batch: Any, chunks: Sequence[Chunk], completed_s: float,
                 ) -> None:
        self.round, self.batch, self.chunks, self.completed_s = round_, batch, chunks, completed_s
        self.spare: Any = None


class FastPath:
    """The C loop over a client's daemon links (the same indices); thread-safe."""

    def __init__(self, links: Sequence[DaemonLink], job: str, layouts: Sequence[int]) -> None:
        assert _tcploop is not None, "check available() first"
        self._links = list(links)
        self._job = job
        self._layouts = tuple(layouts)
        self._codecs = _codecs()
        self._window = WINDOW_PER_DAEMON * len(self._links)
        self._loop = _tcploop.Loop(len(self._links), self._on_event, MAX_WAIT_S, STALL_S)
        self._tokens = itertools.count(1)
        # _lock guards _flights, _done, _streams, _up and _closed: callers (send,
        # settled), the loop thread (events), the links' reader threads (attach).
        self._lock = threading.Lock()
        self._flights: dict[int, _Flight] = {}
        self._by_operation: dict[int, int] = {}  # id(operation) -> token
        # Oldest completion first, as history.py's slots; bounded the same way.
        self._done: OrderedDict[str, _Done] = OrderedDict()
        self._streams: list[LoopStream | None] = [None] * len(self._links)  # the latest
        self._up = [False] * len(self._links)
        self._all_up = False
        self._round_timeout_s = float("inf")  # the shortest the daemons said
        self._closed = False
        self.keys_sent = 0  # keys that went through the loop (tests, diagnostics)
        for index, link in enumerate(self._links):  # their data plane is the loop's now
            tcp = plain_tcp(link)
            assert tcp is not None, "every link plain TCP first (client.py checks)"
            link.use_data_plane(LoopTransport(tcp, index, self._attach))

    @property
    def ready(self) -> bool:
        """Whether every link has its C connection (a key may take the loop)."""
        return self._all_up

    def counters(self) -> tuple[int, int]:
        """(frames the loop sent, replies it took)."""
        return self._loop.counters()

    def wait_ready(self, timeout_s: float) -> bool:
        """Open the links' streams and wait up to timeout_s for all on the loop (tests)."""
        deadline_s = time.monotonic() + timeout_s
        while not self._all_up and time.monotonic() < deadline_s:
            self._open_missing()
            time.sleep(0.01)
        return self._all_up

    def send(self, operation: Operation, values: np.ndarray | None, base: int,
             chunks: list[Chunk], *, rank: int, world_size: int, op: int, priority: int,
             incarnation: int) -> bool:
        """Send the operation's chunks through the loop; False (nothing sent)
        when it cannot take them: a link without its C connection (dialled
        meanwhile), a dtype it does not carry. values: as client._send_chunks."""
        if not self._all_up:
            self._open_missing()
            return False
        codec = self._codecs.get(operation.dtype)
        out = operation.out
        if (codec is None or out.dtype not in _FLOATS or not out.flags.c_contiguous
                or (values is not None and values.dtype not in _FLOATS)):
            return False
        key = operation.key
        with self._lock:
            done = self._done.get(key)
            spare = done.spare if done is not None else None
            if spare is not None:
                done.spare = None  # type: ignore[union-attr]
        if spare is not None and spare.active:
            spare = None
        batch = _tcploop.encode(
            job=self._job, key=key, rank=rank, world_size=world_size, round=operation.round,
            dtype=operation.dtype, op=op, priority=priority, incarnation=incarnation,
            layouts=self._layouts, chunks=chunks, codec=codec[0], param=codec[1],
            values=values, f16_in=values is not None and values.dtype == np.float16,
            base=base, spare=spare)
        token = next(self._tokens)
        with self._lock:
            if self._closed:
                raise ReducerError(grpc.StatusCode.CANCELLED, "client is closed")
            self._flights[token] = _Flight(operation, batch)
            self._by_operation[id(operation)] = token
        try:
            self._loop.submit(batch, token, out, out.dtype == np.float16, self._window,
                              CREDITS_PER_LINK)
        except ValueError:  # a link went down just now: the Python path sends it all
            with self._lock:
                self._flights.pop(token, None)
                self._by_operation.pop(id(operation), None)
            return False
        self.keys_sent += 1
        return True

    def settled(self, operation: Operation, error: ReducerError | None) -> bool:
        """The operation settled (any path); whether it was the loop's. A failed
        one is taken off the loop: it sends no more and leaves the output alone."""
        with self._lock:
            token = self._by_operation.pop(id(operation), None)
            flight = self._flights.pop(token, None) if token is not None else None
            if token is None:  # the Python path's: its round supersedes the loop's
                done = self._done.get(operation.key)
                if error is None and done is not None and done.round <= operation.round:
                    del self._done[operation.key]
                return False
        if error is not None and flight is not None:
            self._loop.cancel(flight.batch)
        return True

    def close(self) -> None:
        """Stop the loop and close its connections; what was open fails elsewhere."""
        with self._lock:
            self._closed = True
            streams, self._streams = self._streams, [None] * len(self._links)
        self._loop.close()
        for stream in streams:  # their links' readers end
            if stream is not None:
                stream.ended(TransportError(grpc.StatusCode.CANCELLED, "client is closed"))

    # -- the loop's events (its thread, the GIL held) --------------------------

    def _on_event(self, kind: str, *args: Any) -> None:
        try:
            if kind == "done":
                self._on_done(*args)
            elif kind == "error":
                self._on_error_reply(*args)
            elif kind == "bad":
                self._on_bad_reply(*args)
            elif kind == "reply":
                self._on_reply(*args)
            elif kind == "down":
                self._on_down(*args)
        except Exception:  # the loop thread must go on; the watchdog bounds the key
            log.exception("client loop: handling %s %r failed", kind, args)

    def _flight(self, token: int, last: bool) -> _Flight | None:
        """The flight of `token`; `last`: its batch is done on the loop. Its
        operation stays known as the loop's until settled() (which it is told
        next): that round is the loop's, its batch the key's next spare."""
        with self._lock:
            flight = self._flights.get(token)
            if last and flight is not None:
                del self._flights[token]
            return flight

    def _on_done(self, token: int, answered: int) -> None:
        flight = self._flight(token, last=True)
        if flight is None:
            return
        operation = flight.operation
        now_s = time.monotonic()
        if answered == len(operation.chunks):  # all on the loop: what a restart may need
            self._remember(operation, flight.batch, now_s)
        operation.answered_many(answered)

    def _remember(self, operation: Operation, batch: Any, now_s: float) -> None:
        key, round_ = operation.key, operation.round
        with self._lock:
            done = self._done.get(key)
            if done is None:
                self._done[key] = _Done(round_, batch, operation.chunks, now_s)
            elif round_ >= done.round:
                if done.batch is not batch:
                    done.spare = done.batch  # no one resends it now
                done.round, done.batch, done.chunks = round_, batch, operation.chunks
                done.completed_s = now_s
                self._done.move_to_end(key)
            self._prune(now_s)
        for link, answered in zip(self._links, batch.daemons, strict=True):
            link.completed_elsewhere(key, round_, answered)

    def _prune(self, now_s: float) -> None:
        """Drop what can no longer help (history.py's rule: a round timeout, MAX_SLOTS)."""
        timeout_s = self._round_timeout_s
        while self._done:
            key, done = next(iter(self._done.items()))
            if done.completed_s >= now_s - timeout_s and len(self._done) <= MAX_SLOTS:
                return
            del self._done[key]

    def _on_error_reply(self, token: int, index: int, code: int, message: bytes) -> None:
        flight = self._flight(token, last=True)
        if flight is None:
            return
        link = self._links[flight.operation.chunks[index].daemon]
        flight.operation.fail(ReducerError(status_code_from_value(code),
                                           f"daemon {link.address}: "
                                           f"{message.decode('utf-8', 'replace')}"))

    def _on_bad_reply(self, token: int, index: int, what: str, got: int, expected: int,
                      ) -> None:
        flight = self._flight(token, last=True)
        if flight is None:
            return
        operation = flight.operation
        problem = (reply_dtype_problem(got, expected) if what == "dtype"
                   else f"reply has {got} bytes, expected {expected}")
        operation.fail(operation.chunk_error(index, problem))

    def _on_reply(self, index: int, gen: int, body: bytes) -> None:
        stream = self._streams[index]
        if stream is not None and stream.gen == gen:
            stream.replied(body)

    def _on_down(self, index: int, gen: int, code: int, text: bytes, status_frame: int,
                 malformed: int, replied: int, orphans: list[tuple[int, int]]) -> None:
        """Connection `gen` of link `index` ended: its open chunks and last
        completed rounds go to the DaemonLink, then its stream ends, so the link
        resends or fails them as after a break on the Python path."""
        link = self._links[index]
        with self._lock:
            stream = self._streams[index]
            if stream is not None and stream.gen != gen:
                stream = None  # an older connection's end: the link has moved on
            if stream is not None:
                self._up[index] = self._all_up = False
            closed = self._closed
        if closed:
            return
        now_s = time.monotonic()
        with self._lock:
            self._prune(now_s)
            kept = [(key, done.round, done.batch, done.chunks)
                    for key, done in self._done.items()]
        for key, round_, batch, chunks in kept:
            link.completed_elsewhere(key, round_, messages=[
                (c.offset, _message(batch, i)) for i, c in enumerate(chunks) if c.daemon == index])
        by_token: dict[int, list[int]] = {}
        for token, chunk in orphans:
            by_token.setdefault(token, []).append(chunk)
        for token, indices in by_token.items():
            flight = self._flight(token, last=False)
            if flight is None:
                continue
            operation = flight.operation
            try:
                for i in indices:
                    chunk = operation.chunks[i]
                    link.send((operation.key, operation.round, chunk.offset),
                              _message(flight.batch, i), operation.handler(i),
                              operation.deadline_s)
            except ReducerError as exc:  # the client closed meanwhile
                operation.fail(exc)
        if stream is not None:
            tcp = plain_tcp(link)
            stream.ended(stream_end_error(stream.where, code, text, bool(status_frame),
                                          bool(malformed), bool(replied), tcp))

    # -- connections -------------------------------------------------------------

    def _open_missing(self) -> None:
        """Have every link without a stream open one (the loop's connection)."""
        for index, link in enumerate(self._links):
            if not self._up[index]:
                link.ensure_stream()

    def _attach(self, index: int, sock: socket.socket, daemon: DaemonInfo,
                requests: Iterable[memoryview]) -> LoopStream:
        """Link `index`'s stream on the loop (its reader thread): the greeted
        socket goes to the loop, which from now on owns it."""
        tcp = plain_tcp(self._links[index])
        assert tcp is not None
        where = f"{tcp.host}:{daemon.data_port}"
        with self._lock:  # before any event of the connection can look for its stream
            if self._closed:
                sock.close()
                raise TransportError(grpc.StatusCode.CANCELLED, "client is closed")
            fd = sock.detach()
            try:
                gen = self._loop.attach(index, fd, tcp.max_message_bytes)
            except BaseException as exc:
                os.close(fd)
                raise TransportError(grpc.StatusCode.UNAVAILABLE,
                                     f"data port {where}: {exc}") from None
            stream = LoopStream(self._loop, index, gen, where, requests)
            self._streams[index] = stream
            self._up[index] = True
            self._all_up = all(self._up)
            if daemon.round_timeout_s:
                self._round_timeout_s = min(self._round_timeout_s, daemon.round_timeout_s)
        stream.start()
        return stream


def _message(batch: Any, index: int) -> Message:
    """Chunk `index`'s frame as a Message of its own, for the Python path."""
    frame = batch.frame(index)
    message = Message(len(frame) - 5)  # HEADROOM is the frame header
    message.buffer[:] = np.frombuffer(frame, dtype=np.uint8)
    return message

