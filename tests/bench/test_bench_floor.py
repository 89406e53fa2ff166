"""The tcp-floor baseline (reducerd/bench/floor.py): reducerd's chunks, echoed per chunk."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
from reducer_wire import dtypes
from reducer_wire.layout import pipelined_chunk_bytes, plan_wire_chunks

from reducerd.bench.floor import LISTENING, FloorComm, serve_on


def _servers(count: int, workers: int) -> list[str]:
    """`count` echo servers on 127.0.0.1 in threads, listening already; their addresses."""
    addresses = []
    for _ in range(count):
        server = socket.create_server(("127.0.0.1", 0))
        addresses.append(f"127.0.0.1:{server.getsockname()[1]}")
        threading.Thread(target=serve_on, args=(server, workers), daemon=True).start()
    return addresses


def _connected(addresses: list[str], rank: int, wire_dtype: str) -> FloorComm:
    return FloorComm({"rank": rank, "addresses": addresses, "wire_dtype": wire_dtype,
                      "stall_timeout_s": 20.0, "chunk_bytes": None})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire_dtype", ["float16", "int8"])
def test_each_daemon_host_gets_reducerds_chunks_and_echoes_them(wire_dtype: str):
    numel, daemons = 300_001, 3
    addresses = _servers(daemons, workers=2)
    comms: list[FloorComm] = []
    for rank in range(2):  # serve() accepts every worker before the first operation
        comms.append(_connected(addresses, rank, wire_dtype))
    for comm in comms:
        comm.prepare(numel)
    dtype = dtypes.WIRE_DTYPES[wire_dtype]
    chunks = plan_wire_chunks(numel, dtype, daemons,
                              pipelined_chunk_bytes(dtypes.wire_nbytes(dtype, numel), daemons),
                              f"bench/{numel}")
    for daemon in range(daemons):
        assert comms[0].sizes[daemon] == [dtypes.wire_nbytes(dtype, c.numel)
                                          for c in chunks if c.daemon == daemon]
    assert sum(map(sum, comms[0].sizes)) == dtypes.wire_nbytes(dtype, numel)
    for _ in range(2):  # two operations on the same connections, each after a barrier
        threads = [threading.Thread(target=lambda c=c: (c.barrier(), c.run())) for c in comms]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        for comm in comms:
            comm.check(numel, 0, 0.0, "tcp-floor")
    # Each worker got its own bytes back, not another's.
    assert not np.array_equal(comms[0].back[0], comms[1].back[0])
    comms[1].back[2][7] ^= 1
    with pytest.raises(AssertionError, match="daemon host 2 echoed byte 7"):
        comms[1].check(numel, 0, 0.0, "tcp-floor")
    for comm in comms:
        comm.close()


@pytest.mark.timeout(60)
def test_workers_that_disagree_on_the_chunks_stop_the_server_with_a_reason():
    server = subprocess.Popen([sys.executable, "-m", "reducerd.bench.floor", "--listen",
                               "127.0.0.1:0", "--workers", "2"],
                              stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        assert line.startswith(LISTENING), line
        port = int(line.rsplit(":", 1)[1])
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        conns[0].sendall(struct.pack("!II", 1, 4) + b"abcd")
        conns[1].sendall(struct.pack("!III", 2, 2, 2) + b"abcd")
        assert server.wait(timeout=20) != 0
        assert "workers disagree on the operation's chunks: [1, 2] chunks" in server.stderr.read()
        for conn in conns:
            conn.close()
    finally:
        server.kill()
        server.wait()
