"""What the adversarial probes share: daemons under an address-space limit, their
memory and threads, raw gRPC streams and data-plane sockets, and the good job
that must be served exactly after (and during) every probe.

Every daemon here runs with RLIMIT_AS set in its own process (before reducerd
is imported), so that a regression that makes it allocate fails the test
with a MemoryError in the daemon instead of calling the host's OOM killer.
Memory is measured as the daemon's VmRSS (/proc/PID/status).

REDUCER_ADVERSARIAL=long runs every probe at the size of the issue's table
(more connections, longer trickles); the default is a short version that
`make test` runs.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from raw_stream import RawStream, metadata  # noqa: F401 (RawStream: the probes import it from here)
from reducer_client import ReducerClient
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from reducer_wire.framing import HELLO, MAGIC, STATUS, frame_header
from support import (  # noqa: F401 (AS_LIMIT_BYTES, limited_daemon: the probes import them here)
    AS_LIMIT_BYTES,
    DaemonProcess,
    limited_daemon,
    start_daemon,
)

LONG = os.environ.get("REDUCER_ADVERSARIAL", "") == "long"
GiB, MiB = 1 << 30, 1 << 20
# The daemon's whole address space: ~0.8 GiB at rest (libraries, thread stacks).
# RSS besides what --max-inflight-bytes admits: socket buffers, gRPC's own, the allocator's.
RSS_SLACK = 48 * MiB

def token_daemon(token: str, *args: str, log_dir: Path, prelude: str = "pass",
                 ) -> DaemonProcess:
    """limited_daemon with --auth-token-file holding `token` (written under log_dir)."""
    token_file = log_dir / "token"
    token_file.write_text(token + "\n")
    return limited_daemon("--auth-token-file", str(token_file), *args, log_dir=log_dir,
                          prelude=prelude)


def proc_status(pid: int, field: str) -> int:
    """A number from /proc/PID/status: VmRSS in bytes, Threads as a count."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            value = line.split()[1]
            return int(value) * 1024 if line.endswith("kB") else int(value)
    raise KeyError(field)


def rss_bytes(daemon: DaemonProcess) -> int:
    return proc_status(daemon.process.pid, "VmRSS")


def threads(daemon: DaemonProcess) -> int:
    return proc_status(daemon.process.pid, "Threads")


def assert_alive(daemon: DaemonProcess) -> None:
    assert daemon.process.poll() is None, f"the daemon died:\n{daemon.log()[-4000:]}"


def shard(job: str, rank: int, world_size: int, values, key: str = "k", round_: int = 0,
          offset: int = 0) -> pb.Shard:
    data = np.asarray(values, dtype="<f4").tobytes()
    return pb.Shard(job=job, rank=rank, world_size=world_size, round=round_, key=key,
                    offset=offset, dtype=pb.DTYPE_FLOAT32, op=pb.REDUCE_OP_SUM, data=data)


def get_status(address: str, token: str | None = None, timeout: float = 5.0,
               **request) -> pb.StatusReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ReducerStub(channel).GetStatus(
            pb.StatusRequest(**request), metadata=metadata(token), timeout=timeout)


def wait_until(predicate, timeout_s: float, step_s: float = 0.1) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passed; whether it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def job_status(daemon: DaemonProcess, name: str) -> pb.JobStatus:
    """GetStatus's row for job `name` (empty if the daemon does not know it)."""
    return next((j for j in get_status(daemon.address).jobs if j.job == name), pb.JobStatus())


def data_port(address: str, token: str | None = None) -> int:
    return get_status(address, token, brief=True).data_port


def data_socket(address: str, token: str | None = None, hello: bool = True,
                timeout: float = 10.0, port: int | None = None) -> socket.socket:
    """A raw data-plane connection, its handshake sent (or not); `port`: the
    daemon's data port where known (else asked for)."""
    host = address.rpartition(":")[0]
    port = data_port(address, token) if port is None else port
    sock = socket.create_connection((host, port), timeout=timeout)
    if hello:
        raw = (token or "").encode()
        sock.sendall(MAGIC + frame_header(HELLO, len(raw)) + raw)
    return sock


def read_status_frame(sock: socket.socket, timeout: float = 10.0) -> tuple[int, str] | None:
    """Read until the daemon closes; the code and message of its last STATUS
    frame (replies before it are skipped), or None if none came."""
    sock.settimeout(timeout)
    received = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    view, last = memoryview(bytes(received)), None
    while len(view) >= 5:
        kind, length = view[0], int.from_bytes(view[1:5], "little")
        if len(view) < 5 + length:
            break
        if kind == STATUS:
            last = (int.from_bytes(view[5:9], "little"), bytes(view[9:5 + length]).decode())
        view = view[5 + length:]
    return last


def good_job(addresses: list[str], job: str = "good", world_size: int = 2,
             token: str | None = None, timeout: float = 20.0, size: int = 4096,
             rounds: int = 2, **options) -> float:
    """Run `rounds` allreduces of `world_size` real clients (threads of this
    process) and check every element exactly; the seconds it took."""
    start = time.monotonic()
    errors: list[BaseException] = []
    results: dict[int, list[np.ndarray]] = {}

    def rank_main(rank: int) -> None:
        try:
            with ReducerClient(addresses, job=job, rank=rank, world_size=world_size,
                               wire_dtype="float32", timeout=timeout, token=token,
                               node_local=False, **options) as client:
                results[rank] = [client.allreduce(_values(rank, r, size), key="w")
                                 for r in range(rounds)]
        except BaseException as exc:  # reported below, with the rank
            errors.append(exc)

    ranks = [threading.Thread(target=rank_main, args=(r,), daemon=True)
             for r in range(world_size)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout + 10)
    assert not errors, f"the good job failed: {errors!r}"
    assert len(results) == world_size, "a rank of the good job hung"
    for r in range(rounds):
        # Small integers: the float32 sums are exact, equal to the float64 reference.
        expected = sum(_values(rank, r, size).astype(np.float64) for rank in range(world_size))
        for rank in range(world_size):
            np.testing.assert_array_equal(results[rank][r], expected.astype(np.float32))
    return time.monotonic() - start


def _values(rank: int, round_: int, size: int) -> np.ndarray:
    return ((np.arange(size) % 97) + 100 * rank + round_).astype(np.float32)
