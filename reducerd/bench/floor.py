"""The "tcp-floor" baseline: reducerd's byte pattern over plain TCP, with no work at all.

What the network alone costs an allreduce shaped like reducerd's: each worker
cuts the gradient's wire bytes into exactly reducerd's chunks (the client's
layout, the same daemons, the same chunk sizes) and streams every daemon host
its share on one TCP connection, paced as reducerd's client paces them: one
sender hands the chunks to their sockets in the layout's order, each socket
with the client's TCP_NOTSENT_LOWAT, so the flows keep in step (without
that, plain TCP was 11 % slower than reducerd at 64 MiB on the emulated
cluster: docs/explanation/performance.md); that host's echo server sends chunk k back
to each worker once all N workers' chunk k is in (the rule a daemon answers
by), echoing each worker its own bytes. No encoding, no summing, no
protocol: the time left beyond the line-rate bound is the emulated network's
(TCP's sharing of the links, headers, the pipeline's two ends) and the
2 cores' scheduling, a floor for what reducerd itself adds. Not a strict
one: each echo server is one Python process whose readers and writers share
its GIL, and reducerd's daemons, with summing threads and a C header parse,
came in a little under it at times (docs/benchmarks/).

Per operation a worker sends a header (`!I` chunk count, then `!I` per chunk:
its bytes); every worker must send the same one, or the server exits naming
the disagreement. A worker checks that every byte came back as it sent it.

Server: `python -m reducerd.bench.floor --listen HOST:PORT --workers N`.
"""

from __future__ import annotations

import argparse
import functools
import socket
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from reducer_wire.framing import TruncatedFrame, recv_exactly

from reducerd.bench.comm import Comm
from reducerd.ops.config import parse_host_port

__all__ = ["FloorComm", "serve", "serve_on", "LISTENING"]

LISTENING = "tcp-floor listening on"
_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", None)
_COUNT = struct.Struct("!I")


def _recv_header(sock: socket.socket) -> list[int] | None:
    """The next operation's chunk sizes; None when the worker closed between operations."""
    head = bytearray(_COUNT.size)
    if not recv_exactly(sock, memoryview(head)):
        return None
    (count,) = _COUNT.unpack(head)
    sizes = bytearray(4 * count)
    _recv_all(sock, memoryview(sizes))
    return list(struct.unpack(f"!{count}I", sizes))


def _recv_all(sock: socket.socket, view: memoryview) -> None:
    """recv_exactly, where the end of the stream is an error however early."""
    if not recv_exactly(sock, view) and len(view):
        raise TruncatedFrame(f"connection ended before {len(view)} expected bytes")


class _Round:
    """One operation on one server: how many workers' chunk k is in, per k."""

    def __init__(self, sizes: list[int], workers: int) -> None:
        self.sizes, self.workers = sizes, workers
        self.arrived = [0] * len(sizes)
        self.cond = threading.Condition()

    def relay(self, sock: socket.socket, buf: bytearray) -> None:
        """Read this worker's chunks into `buf` and send each back once all have it."""
        ends = np.cumsum([0, *self.sizes]).tolist()
        writer = threading.Thread(target=self._send_back, args=(sock, buf, ends), daemon=True)
        writer.start()
        view = memoryview(buf)
        for k in range(len(self.sizes)):
            _recv_all(sock, view[ends[k]:ends[k + 1]])
            with self.cond:
                self.arrived[k] += 1
                self.cond.notify_all()
        writer.join()

    def _all_in(self, k: int) -> bool:
        return self.arrived[k] == self.workers

    def _send_back(self, sock: socket.socket, buf: bytearray, ends: list[int]) -> None:
        view = memoryview(buf)
        for k in range(len(self.sizes)):
            with self.cond:
                self.cond.wait_for(functools.partial(self._all_in, k))
            sock.sendall(view[ends[k]:ends[k + 1]])


def serve(listen: str, workers: int) -> None:
    """Listen on `listen`, say where on stderr, then serve_on()."""
    host, port = parse_host_port(listen, "--listen")
    server = socket.create_server((host, port), backlog=workers)
    print(f"{LISTENING} {host}:{server.getsockname()[1]}", file=sys.stderr, flush=True)
    serve_on(server, workers)


def serve_on(server: socket.socket, workers: int) -> None:
    """Accept `workers` connections on `server` (then close it), and echo operations
    until they all close."""
    with server:
        conns = [server.accept()[0] for _ in range(workers)]
    for conn in conns:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffers = [bytearray() for _ in conns]
    with ThreadPoolExecutor(workers) as pool:
        while True:
            headers = [_recv_header(conn) for conn in conns]
            if all(h is None for h in headers):
                return
            if any(h != headers[0] for h in headers):
                raise SystemExit(f"tcp-floor: workers disagree on the operation's chunks: "
                                 f"{[None if h is None else len(h) for h in headers]} chunks")
            assert headers[0] is not None
            round_ = _Round(headers[0], workers)
            total = sum(headers[0])
            for i, buf in enumerate(buffers):
                if len(buf) != total:  # kept from one operation to the next of a size
                    buffers[i] = bytearray(total)
            for done in [pool.submit(round_.relay, conn, buf)
                         for conn, buf in zip(conns, buffers, strict=True)]:
                done.result()


class FloorComm(Comm):
    """Worker side of tcp-floor: reducerd's chunks of the wire bytes, echoed per chunk."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from reducer_client.transport.tcp import NOTSENT_LOWAT_BYTES

        self.spec, self.rank = spec, spec["rank"]
        self.conns = [socket.create_connection(parse_host_port(a, "daemon host"),
                                               timeout=spec["stall_timeout_s"])
                      for a in spec["addresses"]]
        for conn in self.conns:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if _NOTSENT_LOWAT is not None:  # a chunk handed over is about on the wire
                conn.setsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT, NOTSENT_LOWAT_BYTES)
        self.pool = ThreadPoolExecutor(len(self.conns))

    def prepare(self, numel: int) -> None:
        from reducer_wire import dtypes
        from reducer_wire.layout import KeyLayout

        dtype = dtypes.WIRE_DTYPES[self.spec["wire_dtype"]]
        daemons = len(self.conns)
        link_gbit = self.spec.get("link_gbit")
        layout = KeyLayout.for_link(daemons, self.spec.get("chunk_bytes"),
                                    None if link_gbit is None else link_gbit * 125e6)
        self.sizes: list[list[int]] = [[] for _ in range(daemons)]
        # (daemon, start, end) of each chunk in the layout's order, which is the
        # order one sender hands them to their sockets (as reducerd's links keep in step).
        self.order: list[tuple[int, int, int]] = []
        ends = [0] * daemons
        for chunk in layout.plan(numel, dtype, f"bench/{numel}"):
            nbytes = dtypes.wire_nbytes(dtype, chunk.numel)
            self.sizes[chunk.daemon].append(nbytes)
            self.order.append((chunk.daemon, ends[chunk.daemon], ends[chunk.daemon] + nbytes))
            ends[chunk.daemon] += nbytes
        rng = np.random.default_rng(self.rank)
        self.sent = [rng.integers(0, 256, end, dtype=np.uint8) for end in ends]
        self.back = [np.empty_like(s) for s in self.sent]

    def run(self) -> None:
        receives = [self.pool.submit(_recv_all, conn, back.data)
                    for conn, back in zip(self.conns, self.back, strict=True)]
        for conn, sizes in zip(self.conns, self.sizes, strict=True):
            conn.sendall(_COUNT.pack(len(sizes)) + struct.pack(f"!{len(sizes)}I", *sizes))
        for daemon, start, end in self.order:
            self.conns[daemon].sendall(self.sent[daemon].data[start:end])
        for done in receives:
            done.result()

    def check(self, numel: int, expected: int, allowed: float, label: str) -> None:
        """Every byte back as sent (there is no sum to check)."""
        for daemon, (out, back) in enumerate(zip(self.sent, self.back, strict=True)):
            if not np.array_equal(out, back):
                first = int(np.flatnonzero(out != back)[0])
                raise AssertionError(f"{label}: daemon host {daemon} echoed byte {first} "
                                     f"as {back[first]}, sent {out[first]}")

    def result(self) -> np.ndarray:
        raise NotImplementedError("tcp-floor carries bytes, not sums: see check()")

    def barrier(self) -> None:
        # An operation of one 1-byte chunk: no server echoes it before every rank sent it.
        for conn in self.conns:
            conn.sendall(_COUNT.pack(1) + struct.pack("!I", 1) + b"\0")
        for conn in self.conns:
            _recv_all(conn, memoryview(bytearray(1)))

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.pool.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reducerd.bench.floor")
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--workers", required=True, type=int)
    args = parser.parse_args(argv)
    serve(args.listen, args.workers)


if __name__ == "__main__":
    main()
