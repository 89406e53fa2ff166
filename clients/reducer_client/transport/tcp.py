"""The daemon's TCP data plane as a Transport (reducer_wire.framing), TLS where given.

gRPC Python costs about a CPU-second per GB on each end (scripts/grpc_ceiling.py),
more than the reduction itself. A daemon started with a data port (reducerd
--data-listen; GetStatus reports it as `data_port`) also takes the very same
Shard messages, in-band errors included, over a plain socket. A connection
that ends without a STATUS frame broke (UNAVAILABLE). gRPC keeps the control
plane: health, GetStatus (which finds the data port) and the token check.

Per chunk: the frame header is written into the message's headroom, so header
and Shard leave with one sendall; a reply is read into one receive buffer that
is reused for the next (a reply is consumed before the next is asked for, see
base.py), so nothing is allocated per reply once it has grown to the largest.

TLS (a client with TLS, against a daemon with TLS): the connection is a
reducer_wire.tls.TlsChannel, which the sender and the reader thread may use
at once; its handshake is part of connect(), within the connect timeout.

A daemon that refuses a stream for capacity (RESOURCE_EXHAUSTED before any
reply: too many connections, or no memory for a frame) is not offered again
for REFUSED_BACKOFF_S: open() raises NotOffered meanwhile, so the link sends
through its next transport (gRPC) instead of failing or hammering the port.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator

import grpc
import numpy as np
from reducer_wire.codec import DecodeError, ShardView, decode_shard
from reducer_wire.codes import status_code_from_value
from reducer_wire.framing import (
    HELLO,
    MAGIC,
    SHARD,
    STATUS,
    FrameError,
    TruncatedFrame,
    frame_header,
    parse_status,
    recv_exactly,
    send_at_once,
    set_receive_tick,
    shutdown_quietly,
    tune_socket,
)
from reducer_wire.tls import TLS_REFUSAL, TlsChannel

from reducer_client.transport.base import (
    HEADROOM,
    DaemonInfo,
    NotOffered,
    Transport,
    TransportError,
)

__all__ = ["StreamBroken", "TcpStream", "TcpTransport", "REFUSED_BACKOFF_S", "dial",
           "stream_end_error"]

# After a refusal for capacity, how long gRPC carries this daemon's streams.
REFUSED_BACKOFF_S = 10.0

# A send returns once at most this much of the socket's data is unsent, so a
# chunk handed over is about on the wire: what keeps the links of one
# operation in step (order.py). Far above a fast link's per-wakeup needs.
NOTSENT_LOWAT_BYTES = 128 << 10
_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", None)

# The name this module's callers knew; the seam's error now (base.py).
StreamBroken = TransportError
_FRAME_HEADER_BYTES = len(frame_header(SHARD, 0))
assert _FRAME_HEADER_BYTES <= HEADROOM
_FRAME_START = HEADROOM - _FRAME_HEADER_BYTES  # where a request item's frame begins


def dial(host: str, port: int, token: str, connect_timeout_s: float,
         tls_context: ssl.SSLContext | None = None, server_hostname: str | None = None,
         ) -> tuple[socket.socket, socket.socket | TlsChannel]:
    """A connection to a data port, tuned, greeted (MAGIC, HELLO with the token),
    over TLS with tls_context: (the socket, what to send and receive on). OSError
    (ssl.SSLError for TLS) when the port is unreachable or refuses us."""
    sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    io: socket.socket | TlsChannel = sock
    try:
        sock.settimeout(None)
        tune_socket(sock)
        if _NOTSENT_LOWAT is not None:
            sock.setsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT, NOTSENT_LOWAT_BYTES)
        if tls_context is not None:
            channel = TlsChannel(sock, tls_context, server_side=False,
                                 server_hostname=server_hostname or host)
            set_receive_tick(sock, 0.25)  # the handshake's deadline is checked
            channel.handshake(time.monotonic() + connect_timeout_s)
            set_receive_tick(sock, None)
            io = channel
        token_bytes = token.encode()
        io.sendall(MAGIC + frame_header(HELLO, len(token_bytes)) + token_bytes)
    except BaseException:
        sock.close()
        raise
    return sock, io


def stream_end_error(where: str, code: int, text: bytes, status_frame: bool, malformed: bool,
                     replied: bool, transport: TcpTransport | None) -> TransportError | None:
    """What a TcpStream on data port `where` (host:port) raises where a
    connection the C loop drives (loopstream.py) ended: `text` is the STATUS
    message, the malformed frame, or the break's words. None: the daemon
    ended the stream with OK. A refusal for capacity before any reply keeps
    `transport` off the port for a while, as TcpStream's does."""
    status = status_code_from_value(code)
    if status_frame:
        if status == grpc.StatusCode.OK:
            return None
        if status == grpc.StatusCode.RESOURCE_EXHAUSTED and not replied and transport:
            transport.refused()  # refused for capacity: gRPC for a while
        return TransportError(status, text.decode("utf-8", "replace"))
    if malformed:
        try:
            decode_shard(text)
            details = f"data port {where}: malformed reply"
        except DecodeError as exc:
            details = f"data port {where}: malformed reply: {exc}"
    else:
        details = f"data port {where}: {text.decode('utf-8', 'replace')}"
    return TransportError(status, details)


class TcpTransport(Transport):
    """Streams over the data port that the daemon's brief status names."""

    name = "tcp"
    label = "the TCP data plane"

    def __init__(self, host: str, token: str, max_message_bytes: int,
                 connect_timeout_s: float = 5.0, tls_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None) -> None:
        self.host = host
        self._token = token
        self._max_message_bytes = max_message_bytes
        self._connect_timeout_s = connect_timeout_s
        self._tls_context = tls_context
        self._server_hostname = server_hostname or host
        # Until when a refusal for capacity keeps us off the port (monotonic s).
        self._refused_until_s = 0.0
        # Streams still open, for close(); the reader thread adds, close() reads.
        self._streams: weakref.WeakSet[TcpStream] = weakref.WeakSet()

    def open(self, requests: Iterator[memoryview], daemon: DaemonInfo,
             ) -> Iterable[ShardView]:
        self._check_offered(daemon)
        stream = TcpStream(self.host, daemon.data_port, self._token, requests,
                           self._max_message_bytes, self._connect_timeout_s, self._tls_context,
                           self._server_hostname, on_refused=self._refused)
        try:
            stream.connect()
        except OSError as exc:  # ssl.SSLError is one: a TLS handshake that failed
            raise _unreachable(daemon.data_port, exc) from None
        self._streams.add(stream)
        return stream

    def _check_offered(self, daemon: DaemonInfo) -> None:
        """NotOffered where the daemon has no data port, or it refused us lately."""
        if not daemon.data_port:
            raise NotOffered(grpc.StatusCode.FAILED_PRECONDITION,
                             "the daemon offers no TCP data plane (reducerd --data-listen)",
                             quiet=True)
        if time.monotonic() < self._refused_until_s:
            raise NotOffered(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"data port {daemon.data_port} refused a stream for capacity lately")

    @property
    def plain(self) -> bool:
        """Whether its streams are plain TCP (no TLS): what the C loop can carry."""
        return self._tls_context is None

    @property
    def max_message_bytes(self) -> int:
        return self._max_message_bytes

    def dial_plain(self, daemon: DaemonInfo) -> socket.socket:
        """A greeted plain connection to the daemon's data port for a caller that
        drives it itself (the C loop, fastpath.py); NotOffered as open() says."""
        if not self.plain:
            raise NotOffered(grpc.StatusCode.FAILED_PRECONDITION, "the data plane runs over TLS")
        self._check_offered(daemon)
        try:
            sock, _ = dial(self.host, daemon.data_port, self._token, self._connect_timeout_s)
        except OSError as exc:
            raise _unreachable(daemon.data_port, exc) from None
        return sock

    def refused(self) -> None:
        """A stream on the data port was refused for capacity: gRPC for a while."""
        self._refused()

    def _refused(self) -> None:
        self._refused_until_s = time.monotonic() + REFUSED_BACKOFF_S

    def close(self) -> None:
        """Break the open streams: their readers see the end at once."""
        for stream in list(self._streams):
            stream.shutdown()


def _unreachable(port: int, exc: OSError) -> NotOffered:
    what = f"{TLS_REFUSAL} with" if isinstance(exc, ssl.SSLError) else "cannot connect to"
    return NotOffered(grpc.StatusCode.UNAVAILABLE, f"{what} data port {port}: {exc}")


class TcpStream:
    """One client connection: shards from `requests`, replies by iteration.

    connect() runs on the caller's thread; a sender thread then drains
    `requests` (its end half-closes the connection), and iterating yields the
    daemon's replies until it ends the stream with OK, or raises TransportError.
    """

    def __init__(self, host: str, port: int, token: str, requests: Iterable[memoryview],
                 max_message_bytes: int, connect_timeout_s: float = 5.0,
                 tls_context: ssl.SSLContext | None = None, server_hostname: str | None = None,
                 on_refused: Callable[[], None] | None = None) -> None:
        self.host, self.port = host, port
        self._token = token
        self._requests = requests
        self._max_message_bytes = max_message_bytes
        self._connect_timeout_s = connect_timeout_s
        self._tls_context = tls_context
        self._server_hostname = server_hostname or host
        self._on_refused = on_refused
        self._sock: socket.socket | None = None
        self._io: socket.socket | TlsChannel | None = None  # the socket, or its TLS
        self._rest: memoryview | None = None  # what send_now left, the next item

    def connect(self) -> None:
        """Open the connection (TLS too, where given) and say hello; OSError
        (ssl.SSLError for TLS) when the port is unreachable or refuses us."""
        sock, io = dial(self.host, self.port, self._token, self._connect_timeout_s,
                        self._tls_context, self._server_hostname)
        self._sock, self._io = sock, io
        threading.Thread(target=self._send, args=(io,), daemon=True,
                         name=f"reducer-tcp-send-{self.host}:{self.port}").start()

    @property
    def can_send_now(self) -> bool:
        """Whether send_now() may be used: a plain socket (over TLS only the
        sender thread writes)."""
        return self._sock is not None and self._io is self._sock

    def send_now(self, item: memoryview) -> memoryview:
        """Send the frame of `item` (HEADROOM, then a Shard) without blocking;
        what the socket did not take (empty: all of it went), which must be
        this stream's next request item. Only while the sender thread is idle
        (base.py: direct sends)."""
        sock = self._sock
        assert sock is not None and self._io is sock, "a connected plain socket only"
        frame = item[_FRAME_START:]
        frame[:_FRAME_HEADER_BYTES] = frame_header(SHARD, len(frame) - _FRAME_HEADER_BYTES)
        rest = frame[send_at_once(sock, frame):]  # a broken socket: the sender finds out
        self._rest = rest if rest else None
        return rest

    def shutdown(self) -> None:
        """End the connection both ways (any thread); iteration then stops."""
        if self._sock is not None:
            shutdown_quietly(self._sock)

    def _send(self, io: socket.socket | TlsChannel) -> None:
        sock = self._sock
        assert sock is not None
        try:
            for item in self._requests:
                if item is self._rest:  # the end of a frame that send_now began
                    self._rest = None
                    io.sendall(item)
                    continue
                frame = item[_FRAME_START:]
                frame[:_FRAME_HEADER_BYTES] = frame_header(SHARD, len(frame) - _FRAME_HEADER_BYTES)
                io.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            shutdown_quietly(sock)  # the reader sees the break and reports it

    def __iter__(self) -> Iterator[ShardView]:
        sock, io = self._sock, self._io
        assert sock is not None and io is not None, "connect() first"
        replied = False
        where = f"data port {self.host}:{self.port}"
        header = bytearray(_FRAME_HEADER_BYTES)
        payload = np.empty(0, dtype=np.uint8)  # grows to the largest reply, then reused
        try:
            while True:
                try:
                    if not recv_exactly(io, memoryview(header)):
                        raise TransportError(grpc.StatusCode.UNAVAILABLE,
                                             f"{where}: the daemon closed the connection")
                    kind, length = header[0], int.from_bytes(header[1:], "little")
                    if kind not in (SHARD, STATUS):
                        raise FrameError(f"unexpected frame kind {kind}")
                    if length > self._max_message_bytes:
                        raise FrameError(f"frame of {length} bytes is larger than the "
                                         f"limit of {self._max_message_bytes} bytes")
                    if payload.size < length:
                        payload = np.empty(length, dtype=np.uint8)
                    body = payload.data[:length]
                    if length and not recv_exactly(io, body):
                        raise TruncatedFrame(f"connection ended inside a frame (0 of "
                                             f"{length} bytes)")
                except ssl.SSLError as exc:  # before any reply: our certificate refused
                    what = "connection broke (TLS: " if replied else f"{TLS_REFUSAL} ("
                    raise TransportError(grpc.StatusCode.UNAVAILABLE,
                                         f"{where}: {what}{exc.reason or exc})") from None
                except (OSError, TruncatedFrame) as exc:  # the daemon went away
                    raise TransportError(grpc.StatusCode.UNAVAILABLE,
                                         f"{where}: connection broke ({exc})") from None
                except FrameError as exc:
                    raise TransportError(grpc.StatusCode.INTERNAL, f"{where}: {exc}") from None
                if kind == STATUS:
                    try:
                        code, message = parse_status(body)
                    except FrameError as exc:
                        raise TransportError(grpc.StatusCode.INTERNAL,
                                             f"{where}: {exc}") from None
                    if code == grpc.StatusCode.OK:
                        return
                    if (code == grpc.StatusCode.RESOURCE_EXHAUSTED and not replied
                            and self._on_refused is not None):
                        self._on_refused()  # refused for capacity: gRPC for a while
                    raise TransportError(code, message)
                try:
                    reply = decode_shard(body)
                except DecodeError as exc:
                    raise TransportError(grpc.StatusCode.INTERNAL,
                                         f"{where}: malformed reply: {exc}") from None
                replied = True
                yield reply
        finally:
            shutdown_quietly(sock)
            sock.close()
