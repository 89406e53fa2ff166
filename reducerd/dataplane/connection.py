"""One data-plane connection: its reader thread (the handshake; frames under TLS) and writer.

A plain-TCP connection's frames are read by the loop thread once its
handshake is over (reducerd.dataplane.loop_reader); under TLS its reader
thread reads them. Replies go out from the loop thread itself where the
socket takes them at once, else from the writer thread
(reducerd.dataplane.outbox: direct sends); over TLS from the writer thread
always.

Bounds kept here and in reducerd.dataplane.loop_reader (the values both
share in reducerd.dataplane.base; reducerd.dataplane.plane has the
plane-wide ones):
- the handshake (TLS, preface, HELLO) ends within the handshake timeout of the
  accept: a deadline, checked at every receive (the socket gets a receive tick
  meanwhile), not a timeout per read that a trickle could renew;
- a connection whose job holds its share of the MemoryBudget (unread replies,
  reserved frames: reducerd.core.limits) reads no next frame until that share
  comes free;
- a frame's declared length is reserved from the MemoryBudget before its
  payload is read (waiting up to RESERVE_WAIT_S for room, else the connection
  ends with RESOURCE_EXHAUSTED), and given back once the loop took the shard;
  its payload must arrive within the frame timeout of its header;
- before it reads a frame's payload, a reader thread waits until it has
  fewer than QUEUED_FRAMES shards waiting for the loop, the plane fewer than
  BACKLOG_FRAMES (DataPlane.backlog), and fewer than UNSENT_FRAMES replies
  or UNSENT_BYTES (the loop's untaken frames counted as replies to come)
  wait for its writer: meanwhile the frame stays in the kernel, and TCP
  slows a client that sends but does not read, instead of buffering it;
- a send that makes no progress for the send timeout ends the connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from typing import Any

import grpc
import numpy as np
from reducer_wire.codec import DecodeError, ShardView
from reducer_wire.framing import (
    HELLO,
    MAGIC,
    MAX_HELLO_BYTES,
    SHARD,
    FrameError,
    FrameTimeout,
    TruncatedFrame,
    read_frame,
    read_header,
    recv_exactly,
    recv_ready,
    set_receive_tick,
    set_send_timeout,
    shutdown_quietly,
    status_frame,
    tune_socket,
)
from reducer_wire.tls import TlsChannel

from reducerd.core.limits import Credit
from reducerd.dataplane.base import (
    LINGER_S,
    RESERVE_WAIT_S,
    SKIP_BYTES,
    UNSENT_BYTES,
    UNSENT_FRAMES,
    Plane,
)
from reducerd.dataplane.outbox import GONE, ThreadOutbox
from reducerd.service.session import END, DecodeFault, Stream, daemon_fault_message, decode_request

__all__ = ["Connection", "GONE"]

log = logging.getLogger("reducerd")

QUEUED_FRAMES = 8
# While a deadline runs, a silent socket hands control back this often.
_RECEIVE_TICK_S = 0.25


class Connection:
    """A data-plane connection; serve() is its reader thread."""

    def __init__(self, plane: Plane, sock: socket.socket, peer: str) -> None:
        self.plane = plane
        self.sock = sock
        self.io: Any = sock  # the socket, or its TlsChannel
        self.accepted_s = time.monotonic()
        self.outbox = ThreadOutbox(plane.budget, start_writer=self._start_writer)
        self.stream = Stream(f"tcp:{peer}", inband_errors=True, outbox=self.outbox,
                             frames=True)
        self.credit = Credit(QUEUED_FRAMES)
        self.reader_done = threading.Event()
        self.writer_done = threading.Event()
        self.ticking = False  # a payload's receive tick, kept across frames (_idle)
        self.registered = False  # a Stream of the session (its writer starts on need)
        self.counted_job: str | None = None  # its token's job, counted by the plane
        self.loop_reader: Any = None  # plain TCP on the Python loop: its LoopReader
        self.on_loop = False  # plain TCP: a loop (Python's or C's) reads its frames
        self.c_id = 0  # on the C loop: its id there (reducerd.dataplane.cloop)

    def serve(self) -> None:
        plane, limits = self.plane, self.plane.limits
        try:
            tune_socket(self.sock)
            set_send_timeout(self.sock, limits.send_timeout_s)
            refusal = self._handshake(self.accepted_s + limits.handshake_timeout_s)
            if refusal is None:
                refusal = plane.admit(self)
            if refusal is not None:
                plane.forget(self)
                if refusal[0] is not None:
                    self.refuse(*refusal)
                else:
                    self.sock.close()
                return
            plane.call(plane.session.open_stream, self.stream)
            if self.io is self.sock:  # over TLS only the writer thread writes, this one reads
                self.on_loop = True
                plane.read_plain(self)  # this thread ends here
                return
            self._read_shards()
        except OSError as exc:
            log.debug("data connection %s broke: %r", self.stream.peer, exc)
            if self.registered:
                self.outbox.put_nowait(GONE)
            else:
                plane.forget(self)
                self.sock.close()
        except Exception as exc:  # e.g. MemoryError: our fault; end the stream and say so
            log.exception("data connection %s: reader failed", self.stream.peer)
            if self.registered:
                plane.call(self.stream.end, grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
                _drop_input(self.io)
            else:
                plane.forget(self)
                self.sock.close()
        finally:
            if not self.on_loop:
                self.reader_done.set()

    def _handshake(self, deadline_s: float) -> tuple[Any, str] | None:
        """TLS, the preface and HELLO, all by `deadline_s`; why the client is
        refused ((None, why) to close without a word), or None. The HELLO's
        token binds the connection to its job (a job token)."""
        plane = self.plane
        preface = bytearray(len(MAGIC))
        set_receive_tick(self.sock, _RECEIVE_TICK_S)
        try:
            if plane.tls_context is not None:
                channel = TlsChannel(self.sock, plane.tls_context, server_side=True)
                channel.handshake(deadline_s)
                self.io = channel
            if not recv_exactly(self.io, memoryview(preface), deadline_s) or preface != MAGIC:
                return (grpc.StatusCode.INVALID_ARGUMENT,
                        f"not a reducer data-plane client: expected the preface {MAGIC!r}")
            frame = read_frame(self.io, MAX_HELLO_BYTES, deadline_s)
        except (FrameTimeout, TimeoutError):  # closed without a word: no linger for it
            log.info("data plane: %s did not end its handshake within %g s", self.stream.peer,
                     plane.limits.handshake_timeout_s)
            return None, "handshake timeout"
        except ssl.SSLError as exc:
            log.info("data plane: TLS handshake with %s failed: %s", self.stream.peer, exc)
            return None, "TLS handshake failed"
        except FrameError as exc:
            if preface != MAGIC:
                return (grpc.StatusCode.INVALID_ARGUMENT,
                        f"not a reducer data-plane client: expected the preface {MAGIC!r}")
            return grpc.StatusCode.INVALID_ARGUMENT, f"bad HELLO frame: {exc}"
        finally:
            set_receive_tick(self.sock, None)
        if frame is None or frame[0] != HELLO:
            return grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be HELLO"
        grant = plane.access.grant(bytes(frame[1]))
        if grant is None:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong token in the data-plane HELLO")
        self.stream.job = grant.job
        if grant.job is not None:
            self.stream.count_against(grant.job)
        return None

    def _read_shards(self) -> None:
        plane, limits = self.plane, self.plane.limits
        ending = False  # we asked the loop to end the stream: read and drop the rest
        while True:
            try:
                header = read_header(self.io, limits.max_message_bytes, on_tick=self._idle)
                if header is None:  # the client half-closed: answer what is open, then OK
                    plane.call(self.stream.half_close)
                    return
                kind, length = header
                if ending or self.stream.ended or self.writer_done.is_set():
                    self._skip(length)  # so the client sees our status, not a reset
                    continue
                if kind != SHARD:
                    ending = True
                    plane.call(self.stream.end, grpc.StatusCode.INVALID_ARGUMENT,
                               f"unexpected frame kind {kind} after HELLO")
                    self._skip(length)
                    continue
                job = self.stream.tenant  # fixed from here on: what is counted goes back
                if not self._wait_for_job_room(job):  # the writer is gone
                    self._skip(length)
                    continue
                if not plane.budget.reserve(length, RESERVE_WAIT_S, job):
                    plane.call(self.stream.end, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               plane.budget.no_room(length, job, RESERVE_WAIT_S))
                    _drop_input(self.io, LINGER_S)
                    return
                if not self._wait_for_room():  # the writer is gone: nothing more is taken
                    plane.budget.give_transport(length, job)
                    self._skip(length)
                    continue
                try:
                    payload = self._receive(length)
                except BaseException:
                    plane.budget.give_transport(length, job)
                    self._give_room()
                    raise
            except FrameTimeout as exc:
                plane.call(self.stream.end, grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"a frame of {length} bytes did not arrive within "
                           f"{limits.frame_timeout_s:g} s of its header ({exc})")
                _drop_input(self.io, LINGER_S)
                return
            except FrameError as exc:
                # The byte stream cannot be followed any further: end with why.
                plane.call(self.stream.end, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                _drop_input(self.io)
                return
            self.outbox.promise(length)
            plane.call(self._accept, decode_request(payload), length, job)
            # Not kept while waiting for the next header: with hundreds of
            # connections, each one's last frame would add up.
            del payload

    def _wait_for_job_room(self, job: str | None) -> bool:
        """Wait while the stream's job holds its whole share of the budget (its
        clients do not read their replies); False once the writer is gone."""
        while not self.plane.budget.wait_job_room(job, 1.0):
            if self.writer_done.is_set():
                return False
        return True

    def _wait_for_room(self) -> bool:
        """Wait while the loop is behind (this connection's credit, the plane's
        backlog) or the client does not read its replies; False once the
        writer is gone. True: a credit and a backlog slot are taken."""
        while not (self.outbox.wait_below(UNSENT_FRAMES, UNSENT_BYTES, 1.0)
                   and self.credit.acquire(timeout=1.0)):
            if self.writer_done.is_set():
                return False
        while not self.plane.backlog.acquire(timeout=1.0):
            if self.writer_done.is_set():
                self.credit.release()
                return False
        return True

    def _give_room(self) -> None:
        self.credit.release()
        self.plane.backlog.release()

    def _receive(self, length: int) -> memoryview:
        """A payload, within the frame timeout of its header, into a fresh
        buffer. What the socket already holds is taken without waiting; only
        a payload still arriving needs the receive tick, set once and kept
        until a tick passes before the next header (_idle)."""
        deadline_s = time.monotonic() + self.plane.limits.frame_timeout_s
        payload = np.empty(length, np.uint8).data
        got = recv_ready(self.sock, payload) if self.io is self.sock else 0
        if got == length:
            return payload
        if not self.ticking:
            set_receive_tick(self.sock, _RECEIVE_TICK_S)
            self.ticking = True
        if not recv_exactly(self.io, payload[got:], deadline_s):
            raise TruncatedFrame(f"connection ended inside a frame ({got} of {length} bytes)")
        return payload

    def _idle(self) -> None:
        """A tick passed before the next header: wait for it without one (setting
        and clearing the tick for every frame cost more GIL time than the adds)."""
        if self.ticking:
            set_receive_tick(self.sock, None)
            self.ticking = False

    def _skip(self, length: int) -> None:
        """Read and drop `length` bytes (nothing is reserved for them)."""
        scratch = memoryview(bytearray(min(length, SKIP_BYTES)))
        while length:
            view = scratch[:min(length, len(scratch))]
            if not recv_exactly(self.io, view):
                return
            length -= len(view)

    def refuse(self, code: grpc.StatusCode, message: str) -> None:
        # On this connection's thread: the loop thread keeps the limiter.
        self.plane.call(self.plane.session.refusals.log, logging.INFO,
                        ("data plane", self.counted_job, code.name),
                        f"data plane: refused {self.stream.peer}: {message}")
        # Lingering holds a descriptor and this thread: a flood of refused
        # connections gets its status in one try and the socket closed.
        lingering = self.plane.refusing.acquire(blocking=False)
        try:
            self.sock.settimeout(LINGER_S if lingering else 0.0)
            self.io.sendall(status_frame(code, message))
            self.sock.shutdown(socket.SHUT_WR)
            if lingering:
                _drop_input(self.io, LINGER_S)
        except OSError:
            pass
        finally:
            self.sock.close()
            if lingering:
                self.plane.refusing.release()

    # -- on the loop thread --------------------------------------------------

    def _accept(self, shard: ShardView | DecodeError | DecodeFault, length: int,
                job: str | None) -> None:
        try:
            self.plane.session.accept(shard, self.stream)  # it answers its own faults
        except Exception as exc:  # still a bug must end this stream, not hang its client
            log.exception("data connection %s: shard not taken", self.stream.peer)
            self.stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
        finally:
            self.outbox.kept(length)
            self._give_room()
            # The table copied what it keeps: the frame's buffer is free.
            self.plane.budget.give_transport(length, job)

    # -- the writer thread ---------------------------------------------------

    def _start_writer(self) -> None:
        """Once the outbox first holds what must wait for a writer (see
        ThreadOutbox): a registered connection's replies, then its end."""
        threading.Thread(target=self._write, daemon=True,
                         name=f"reducerd-data-write-{self.stream.peer}").start()

    def _write(self) -> None:
        try:
            while True:
                item, already_sent = self.outbox.take()
                if item is GONE:
                    break
                if item is END:
                    self.io.sendall(status_frame(grpc.StatusCode.OK, ""))
                    break
                if isinstance(item, tuple):
                    self.io.sendall(status_frame(*item))
                    break
                # Frame header and message: one buffer (its start may have gone
                # out already, sent directly by the loop: reducerd.dataplane.outbox).
                self.io.sendall(item.frame[already_sent:])
                self.outbox.sent(item)
                del item  # a sent reply is not kept while waiting for the next one
        except OSError as exc:  # broken, or no progress for the send timeout
            log.debug("data connection %s broke while sending: %r", self.stream.peer, exc)
        finally:
            self.outbox.discard()
            self.writer_done.set()
            # Half-close, give the client time to read our last frame and close
            # its side (the reader drains meanwhile), then close.
            shutdown_quietly(self.sock, socket.SHUT_WR)
            if not self.reader_done.wait(LINGER_S):
                shutdown_quietly(self.sock, socket.SHUT_RDWR)
                self.reader_done.wait(LINGER_S)
            if self.loop_reader is None:
                self.sock.close()
            else:  # where the loop stops watching it first
                self.plane.call(self._close_on_loop)
            self.plane.forget(self)
            self.plane.call(self.plane.session.close_stream, self.stream)

    def _close_on_loop(self) -> None:
        assert self.loop_reader is not None
        self.loop_reader.finish()
        self.sock.close()


def _drop_input(io: Any, timeout_s: float | None = None) -> None:
    """Read and drop until the client closes (or `timeout_s`, or the writer's
    linger shuts the socket down)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    scratch = memoryview(bytearray(SKIP_BYTES))
    try:
        while True:
            with contextlib.suppress(BlockingIOError):  # a receive tick passed: go on
                if not io.recv_into(scratch):
                    return
            if deadline is not None and time.monotonic() > deadline:
                return
    except (OSError, ssl.SSLError):
        pass
