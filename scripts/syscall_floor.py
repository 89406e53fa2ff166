"""The data plane's syscall floor on this machine: loopback receive and send cost per GB.

A daemon that sums G GB of input receives G GB (the shards) and sends about
G GB (one reply per shard, the same wire dtype): whatever its code, it pays
at least recv + send CPU per GB. This measures both on a bare loopback
socket pair with the daemon's frame size, so a daemon's GB per CPU-second
(scripts/many_contributors.py) can be read against it.

Each side runs in its own process; the CPU seconds are the measured side's
own (user + system), so "send" includes the peer's TCP receive processing
that the kernel runs in the sender's context on loopback.

    .venv/bin/python scripts/syscall_floor.py --gb 2 --frame-kib 256

The machine's other load changes every figure; runs are meant to be short.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time

from reducerd.bench.host import cpu_model


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _send_all(sock: socket.socket, total_bytes: int, frame_bytes: int) -> float:
    buf = memoryview(bytearray(frame_bytes))
    start = _cpu_s()
    left = total_bytes
    while left > 0:
        sock.sendall(buf[:min(left, frame_bytes)])
        left -= frame_bytes
    sock.shutdown(socket.SHUT_WR)
    return _cpu_s() - start


def _recv_all(sock: socket.socket, frame_bytes: int) -> float:
    buf = memoryview(bytearray(frame_bytes))
    start = _cpu_s()
    while True:
        got = 0
        while got < frame_bytes:  # a frame at a time, as the daemon receives a payload
            n = sock.recv_into(buf[got:])
            if not n:
                return _cpu_s() - start
            got += n


def measure(measured: str, total_bytes: int, frame_bytes: int) -> float:
    """CPU seconds of the `measured` side ('send' or 'recv') for total_bytes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other side, in its own process
        os.close(read_fd)
        code = 0
        try:
            if measured == "recv":
                sock = socket.create_connection(("127.0.0.1", port))
                _send_all(sock, total_bytes, frame_bytes)
                sock.recv(1)  # wait for the receiver's close
            else:
                sock, _ = listener.accept()
                _recv_all(sock, frame_bytes)
            sock.close()
        except OSError:
            code = 1
        os._exit(code)
    os.close(write_fd)
    if measured == "recv":
        sock, _ = listener.accept()
        cpu = _recv_all(sock, frame_bytes)
    else:
        sock = socket.create_connection(("127.0.0.1", port))
        cpu = _send_all(sock, total_bytes, frame_bytes)
        sock.recv(1)
    sock.close()
    listener.close()
    os.waitpid(pid, 0)
    os.close(read_fd)
    return cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="bytes moved per side, in GB")
    parser.add_argument("--frame-kib", type=int, default=256, help="bytes per send/receive")
    args = parser.parse_args()
    total, frame = int(args.gb * 1e9), args.frame_kib << 10
    wall = time.monotonic()
    recv_s = measure("recv", total, frame) / args.gb
    send_s = measure("send", total, frame) / args.gb
    floor = recv_s + send_s
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs)")
    print(f"loopback, {args.frame_kib} KiB frames, {args.gb:g} GB per side:")
    print(f"  receive  {recv_s:.3f} CPU-s per GB")
    print(f"  send     {send_s:.3f} CPU-s per GB (with the peer's TCP receive work)")
    print(f"  floor    {floor:.3f} CPU-s per GB of input (receive + reply): "
          f"at most {1 / floor:.2f} GB of input per CPU-second")
    print(f"({time.monotonic() - wall:.1f} s wall; other load on the machine raises every figure)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
