"""A light load generator: many contributors against one daemon, no framework.

Each contributor is one TCP data-plane connection (reducer_wire.framing) that
sends prepared float16 chunks of one key, round after round, and checks every
result exactly. A worker process drives many contributors with two threads
(one sends, chunk by chunk across its connections, one reads every
connection through a selector), so one machine can stand in for 256 workers.
No ReducerClient: no layout, resend or conversion work competes with the
daemon for the CPU; the daemon sees the very frames a client sends.

Data: rank r sends (r + i) mod m at element i (m small enough that the sum
of all ranks, at most (m - 1) x ranks, stays an integer float16 holds
exactly: <= 2048), so every result is known in advance and compared bit for
bit. Per-chunk latency is from a contributor's send of a chunk to its reply.

    python -m reducerd.bench.loadgen --address 127.0.0.1:PORT --contributors 64 \\
        --processes 4 --key-bytes 1M --chunk-bytes 256K --rounds 10

(PORT: the daemon's data port, `reducerd status` or its log's "data plane on".)
Workers speak JSON lines on stdin/stdout with the driver (run_load).
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardEncoder, decode_shard
from reducer_wire.framing import (
    FRAME_HEADER_BYTES,
    HELLO,
    MAGIC,
    SHARD,
    STATUS,
    frame_header,
    parse_status,
    read_frame,
    tune_socket,
)

__all__ = ["LoadSpec", "LoadWorker", "run_load", "worker_main", "pattern_modulus", "expected_sum"]

ITEMSIZE = 2  # float16 on the wire
EXACT_FLOAT16_INT = 2048  # every integer up to 2^11 is a float16


@dataclass(frozen=True)
class LoadSpec:
    """One load: `contributors` ranks of one job, each a connection."""

    host: str
    port: int
    contributors: int
    key_bytes: int = 1 << 20  # per contributor, float16 on the wire
    chunk_bytes: int = 256 << 10
    rounds: int = 5
    warmup: int = 1
    job: str = "loadgen"
    token: str = ""
    timeout_s: float = 120.0

    @property
    def chunk_numels(self) -> list[int]:
        numel, per = self.key_bytes // ITEMSIZE, self.chunk_bytes // ITEMSIZE
        return [min(per, numel - start) for start in range(0, numel, per)]


def pattern_modulus(contributors: int) -> int:
    """The largest m <= 8 with (m - 1) x contributors <= 2048 (at least 2)."""
    return max(2, min(8, EXACT_FLOAT16_INT // contributors + 1))


def expected_sum(contributors: int, numel: int) -> np.ndarray:
    """sum over ranks r of (r + i) mod m, element i, as float16 (exact by choice of m)."""
    m = pattern_modulus(contributors)
    per_residue = [sum((r + k) % m for r in range(contributors)) for k in range(m)]
    return np.array(per_residue, dtype=np.float16)[np.arange(numel) % m]


class LoadWorker:
    """The contributors of one process: ranks [first, first + count)."""

    def __init__(self, spec: LoadSpec, first: int, count: int) -> None:
        self.spec, self.ranks = spec, range(first, first + count)
        numel = spec.key_bytes // ITEMSIZE
        self.modulus = m = pattern_modulus(spec.contributors)
        # Rank r's data is base[r % m:][:numel]: one array for every rank.
        self.base = (np.arange(numel + m) % m).astype(np.float16)
        self.expected = expected_sum(spec.contributors, numel).view(np.uint8)
        self.offsets = np.cumsum([0, *spec.chunk_numels[:-1]]).tolist()
        self.socks: dict[socket.socket, int] = {}
        self.sent_s: dict[tuple[int, int], float] = {}  # (rank, offset) -> send time
        self.latencies_s: list[float] = []
        self.errors: list[str] = []
        self.done = threading.Event()
        self.pending = 0
        self.lock = threading.Lock()  # guards sent_s, pending, errors (both threads)

    def connect(self) -> None:
        token = self.spec.token.encode()
        for rank in self.ranks:
            sock = socket.create_connection((self.spec.host, self.spec.port), timeout=10)
            sock.settimeout(self.spec.timeout_s)
            tune_socket(sock)
            sock.sendall(MAGIC + frame_header(HELLO, len(token)) + token)
            self.socks[sock] = rank

    def run_round(self, round_: int, record: bool) -> float:
        """Send every chunk of every rank (chunk by chunk), wait for every reply."""
        spec = self.spec
        self.done.clear()
        with self.lock:
            self.pending = len(self.socks) * len(self.offsets)
        start = time.perf_counter()
        frames: dict[int, bytearray] = {}  # reused: sendall has copied it out on return
        for offset, numel in zip(self.offsets, spec.chunk_numels, strict=True):
            for sock, rank in self.socks.items():
                encoder = ShardEncoder(job=spec.job, key="grad", rank=rank,
                                       world_size=spec.contributors, round=round_,
                                       offset=offset, dtype=pb.DTYPE_FLOAT16,
                                       op=pb.REDUCE_OP_SUM, data_nbytes=numel * ITEMSIZE)
                frame = frames.get(encoder.nbytes)
                if frame is None:
                    frame = frames[encoder.nbytes] = bytearray(FRAME_HEADER_BYTES
                                                               + encoder.nbytes)
                    frame[:FRAME_HEADER_BYTES] = frame_header(SHARD, encoder.nbytes)
                payload = encoder.write_into(memoryview(frame)[FRAME_HEADER_BYTES:])
                shift = rank % self.modulus
                np.frombuffer(payload, np.float16)[:] = self.base[shift + offset:][:numel]
                with self.lock:
                    self.sent_s[rank, offset] = time.perf_counter()
                sock.sendall(frame)
        if not self.done.wait(spec.timeout_s):
            raise TimeoutError(f"round {round_}: {self.pending} replies missing after "
                               f"{spec.timeout_s:g} s")
        elapsed = time.perf_counter() - start
        if not record:
            with self.lock:
                self.latencies_s.clear()
        return elapsed

    def read_replies(self) -> None:
        """Reader thread: every reply checked against the known sum."""
        selector = selectors.DefaultSelector()
        for sock in self.socks:
            selector.register(sock, selectors.EVENT_READ)
        open_socks = len(self.socks)
        while open_socks:
            for key, _ in selector.select(timeout=1.0):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    frame = read_frame(sock, 64 << 20)
                except OSError as exc:
                    frame, error = None, f"rank {self.socks[sock]}: {exc!r}"
                    self.error(error)
                if frame is None or frame[0] == STATUS:
                    if frame is not None:
                        code, message = parse_status(frame[1])
                        if code.name != "OK":
                            self.error(f"rank {self.socks[sock]}: {code.name} {message}")
                    selector.unregister(sock)
                    open_socks -= 1
                    continue
                self.on_reply(self.socks[sock], frame[1])
        selector.close()

    def on_reply(self, rank: int, payload: memoryview) -> None:
        """Check one reply (reader thread); the round is done when none is pending."""
        now = time.perf_counter()
        shard = decode_shard(payload)
        if shard.error_code:
            self.error(f"rank {rank} offset {shard.offset}: error {shard.error_code} "
                        f"{shard.error_message}")
        else:
            start = shard.offset * ITEMSIZE
            got = np.frombuffer(shard.data, np.uint8)
            if not np.array_equal(got, self.expected[start:start + len(got)]):
                self.error(f"rank {rank} round {shard.round} offset {shard.offset}: "
                            "wrong sum")
        with self.lock:
            sent = self.sent_s.pop((rank, shard.offset), None)
            if sent is not None:
                self.latencies_s.append(now - sent)
            self.pending -= 1
            if self.pending <= 0:
                self.done.set()

    def error(self, message: str) -> None:
        with self.lock:
            if len(self.errors) < 20:
                self.errors.append(message)

    def close(self) -> None:
        for sock in self.socks:
            sock.shutdown(socket.SHUT_WR)  # the half-close: the daemon ends with OK


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def worker_main(spec: LoadSpec, first: int, count: int) -> int:
    """One worker process (JSON lines to the driver): connect, say so, wait for a
    line; warm up, say so, wait for a line; run the timed rounds, say so, wait
    for a line; close its connections and report."""
    worker = LoadWorker(spec, first, count)
    worker.connect()
    reader = threading.Thread(target=worker.read_replies, daemon=True, name="loadgen-read")
    reader.start()
    _say({"state": "connected"})
    sys.stdin.readline()  # every worker is connected
    round_s: list[float] = []
    try:
        for round_ in range(spec.warmup):
            worker.run_round(round_, record=False)
        _say({"state": "ready"})
        sys.stdin.readline()  # "go": every worker is warm
        for round_ in range(spec.warmup, spec.warmup + spec.rounds):
            round_s.append(worker.run_round(round_, record=True))
    except (OSError, TimeoutError) as exc:
        worker.error(f"ranks {first}..{first + count - 1}: {exc!r}")
    _say({"state": "timed"})
    sys.stdin.readline()  # every worker's timed rounds are over
    worker.close()
    reader.join(spec.timeout_s)
    _say({"state": "done", "round_s": round_s, "latencies_s": worker.latencies_s,
          "errors": worker.errors})
    return 0 if not worker.errors else 1


def run_load(spec: LoadSpec, processes: int, on_connected: Any = None,
             on_ready: Any = None, on_timed: Any = None) -> dict[str, Any]:
    """Start `processes` workers sharing the contributors; return their merged figures.

    `on_connected()` runs once every contributor's connection is open (before
    any shard), `on_ready()` once all are warmed up, just before the timed
    rounds, and `on_timed()` once every timed round is answered, before any
    connection closes: to sample the daemon's memory and CPU then (closing
    hundreds of streams is a cost per connection, not per round).
    """
    processes = max(1, min(processes, spec.contributors))
    shares = [spec.contributors // processes + (i < spec.contributors % processes)
              for i in range(processes)]
    firsts = np.cumsum([0, *shares[:-1]]).tolist()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "reducerd.bench.loadgen", "--worker", json.dumps(asdict(spec)),
         str(first), str(share)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for first, share in zip(firsts, shares, strict=True)]
    try:
        _step(procs, "connected", on_connected)
        _step(procs, "ready", on_ready)
        started = time.perf_counter()
        _step(procs, "timed", on_timed)
        wall_s = time.perf_counter() - started
        reports = []
        for proc in procs:
            out = proc.communicate(timeout=spec.timeout_s * 2)[0]
            if not out.strip():
                raise RuntimeError(f"load worker exited with {proc.returncode} and no report")
            reports.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    latencies = np.array([x for r in reports for x in r["latencies_s"]])
    timed = min(len(r["round_s"]) for r in reports)  # fewer where a worker failed
    rounds = np.max([r["round_s"][:timed] for r in reports], axis=0) if timed else np.zeros(1)
    return {
        "contributors": spec.contributors, "processes": processes, "wall_s": wall_s,
        "input_bytes": spec.contributors * spec.key_bytes * spec.rounds,
        "round_s": {"median": float(np.median(rounds)), "max": float(rounds.max())},
        "chunk_latency_s": {q: float(np.percentile(latencies, p)) for q, p in (
            ("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))} if latencies.size else {},
        "chunks_timed": int(latencies.size),
        "errors": [e for r in reports for e in r["errors"]],
    }


def _step(procs: list[subprocess.Popen], state: str, callback: Any) -> None:
    """Wait until every worker says `state`, run `callback`, let them all go on."""
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line or json.loads(line).get("state") != state:
            raise RuntimeError(f"load worker failed before {state!r}: {line!r}")
    if callback is not None:
        callback()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker_main(LoadSpec(**json.loads(argv[1])), int(argv[2]), int(argv[3]))
    parser = argparse.ArgumentParser(prog="python -m reducerd.bench.loadgen",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="the daemon's data port, HOST:PORT")
    parser.add_argument("--contributors", type=int, required=True)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--key-bytes", type=int, default=1 << 20)
    parser.add_argument("--chunk-bytes", type=int, default=256 << 10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--token", default="")
    args = parser.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    spec = LoadSpec(host, int(port), args.contributors, args.key_bytes, args.chunk_bytes,
                    args.rounds, args.warmup, token=args.token)
    result = run_load(spec, args.processes)
    print(json.dumps(result, indent=2))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
