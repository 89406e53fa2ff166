"""The TCP data plane beside gRPC: same results, same errors, clear refusals.

Real daemons; workers are spawned processes, raw connections speak the
framing of reducer_wire.framing by hand.
"""

import socket
import struct
import time

import grpc
import numpy as np
import pytest
from core_cases import matrix_worker
from raw_frames import HELLO_OK, data_port, frame, raw_session, status_of
from reducer_client import ReducerClient, ReducerError
from reducer_client.transport import tcp
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from reducer_wire.codec import decode_shard, encode_shard
from reducer_wire.framing import HELLO, MAGIC, SHARD, STATUS
from support import run_workers, start_daemon

# Every test on each loop that reads plain-TCP frames (conftest.data_loop).
pytestmark = pytest.mark.usefixtures("data_loop")

CASES = [(wire, op, numel, "float32")
         for wire in ("float16", "bfloat16", "float32")
         for op, numel in (("sum", 1001), ("mean", 3 << 20))]


def bytes_held(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ReducerStub(channel).GetStatus(pb.StatusRequest(), timeout=5).bytes_held


def shard_bytes(rank=0, world_size=1, key="k", values=(1.0, 2.0), **fields):
    data = np.asarray(values, dtype="<f2").tobytes()
    return encode_shard(**{"job": "raw", "rank": rank, "world_size": world_size, "key": key,
                           "dtype": pb.DTYPE_FLOAT16, "op": pb.REDUCE_OP_SUM, "data": data,
                           **fields})


@pytest.fixture
def daemon(tmp_path):
    d = start_daemon("--round-timeout", "3", "--max-message-bytes", "65536", log_dir=tmp_path)
    yield d
    d.stop()


def test_tcp_grpc_and_numpy_codecs_give_the_same_bytes(tmp_path):
    """Every combination of data plane and codec (C or NumPy, on the workers
    and on the daemons) gives bit-identical results within the float64 bound.
    Two workers: a + b == b + a, so arrival order cannot change the bits."""
    digests = {}
    for daemon_env in ({}, {"REDUCER_WIRE_NUMPY": "1"}):
        daemons = [start_daemon(log_dir=tmp_path, env=daemon_env) for _ in range(2)]
        try:
            addresses = [d.address for d in daemons]
            for plane, numpy_codec in (("tcp", "0"), ("grpc", "0"), ("tcp", "1")):
                env = {"REDUCER_DATA_PLANE": plane, "REDUCER_WIRE_NUMPY": numpy_codec}
                job = f"{plane}-{numpy_codec}"
                results = run_workers(matrix_worker, 2, (addresses, CASES, job), env=env,
                                      timeout=240)
                for rank_results in results:
                    for result in rank_results:
                        assert result["ratio"] <= 1.0, result
                        # A small key goes to one daemon: its link alone is open yet.
                        used = [t for t in result["transports"] if t is not None]
                        assert used and set(used) == {plane}, result["transports"]
                    assert rank_results[-1]["transports"] == [plane, plane]
                label = (tuple(daemon_env), plane, numpy_codec)
                digests[label] = [[r["digest"] for r in rank] for rank in results]
        finally:
            for d in daemons:
                d.stop()
    first = next(iter(digests.values()))
    assert all(rank == first[0] for rank in first)
    for label, got in digests.items():
        assert got == first, label


def test_status_reports_the_port_and_a_fixed_port_is_used(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = start_daemon("--data-listen", f"127.0.0.1:{port}", log_dir=tmp_path)
    try:
        assert data_port(d.address) == port
        assert f"data plane on 127.0.0.1:{port}" in d.log()
        with ReducerClient([d.address], job="j", rank=0, world_size=1) as client:
            assert client.allreduce(np.arange(5, dtype=np.float32), "k").tolist() == [
                0, 1, 2, 3, 4]
            assert client.transports == ["tcp"]
    finally:
        d.stop()


def test_off_means_grpc_for_auto_and_a_clear_error_for_tcp(tmp_path):
    d = start_daemon("--data-listen", "off", log_dir=tmp_path)
    try:
        assert data_port(d.address) == 0
        with ReducerClient([d.address], job="j", rank=0, world_size=1) as client:
            assert client.allreduce(np.ones(3, dtype=np.float32), "k").tolist() == [1, 1, 1]
            assert client.transports == ["grpc"]
        with ReducerClient([d.address], job="j2", rank=0, world_size=1, timeout=20,
                           data_plane="tcp") as client:
            start = time.monotonic()
            with pytest.raises(ReducerError) as info:
                client.allreduce(np.ones(3, dtype=np.float32), "k")
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "--data-listen" in str(info.value)
            assert time.monotonic() - start < 5  # not retried until the timeout
    finally:
        d.stop()


def test_unreachable_data_port_falls_back_to_grpc(daemon, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused (test)")
    monkeypatch.setattr(tcp, "dial", refuse)  # every data connection dials through it
    with ReducerClient([daemon.address], job="j", rank=0, world_size=1) as client:
        assert client.allreduce(np.ones(3, dtype=np.float32), "k").tolist() == [1, 1, 1]
        assert client.transports == ["grpc"]
    assert "unreachable" in caplog.text and "through gRPC" in caplog.text
    with ReducerClient([daemon.address], job="j2", rank=0, world_size=1, timeout=1.5,
                       data_plane="tcp") as client:
        with pytest.raises(ReducerError) as info:
            client.allreduce(np.ones(3, dtype=np.float32), "k")
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "Connection refused (test)" in str(info.value)


def test_hello_must_carry_the_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    d = start_daemon("--auth-token-file", str(token_file), log_dir=tmp_path)
    try:
        port = data_port(d.address, token="s3cret")
        assert port
        host = d.address.rpartition(":")[0]
        for token in (b"", b"wrong", b"s3cret\n"):
            with socket.create_connection((host, port), timeout=10) as sock:
                sock.sendall(MAGIC + frame(HELLO, token) + frame(SHARD, shard_bytes()))
                sock.shutdown(socket.SHUT_WR)
                received = b"".join(iter(lambda: sock.recv(1 << 16), b""))
            assert received[0] == STATUS, received
            code, message = struct.unpack_from("<I", received, 5)[0], received[9:].decode()
            assert code == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert "token" in message
        with ReducerClient([d.address], job="j", rank=0, world_size=1,
                           token="s3cret") as client:
            assert client.allreduce(np.ones(2, dtype=np.float32), "k").tolist() == [1, 1]
            assert client.transports == ["tcp"]
        assert "s3cret" not in d.log()
    finally:
        d.stop()


@pytest.mark.parametrize("payload,code,words", [
    (b"GET / HTTP/1.1\r\n\r\n", grpc.StatusCode.INVALID_ARGUMENT, "preface"),
    (MAGIC + frame(SHARD, b""), grpc.StatusCode.INVALID_ARGUMENT, "HELLO"),
    (HELLO_OK + struct.pack("<BI", SHARD, 1 << 20), grpc.StatusCode.INVALID_ARGUMENT,
     "larger than the limit of 65536"),
    (HELLO_OK + frame(9, b"x"), grpc.StatusCode.INVALID_ARGUMENT, "unknown frame kind 9"),
    (HELLO_OK + frame(HELLO, b""), grpc.StatusCode.INVALID_ARGUMENT, "unexpected frame kind"),
    (HELLO_OK + frame(SHARD, b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT,
     "malformed Shard"),
    (HELLO_OK + frame(SHARD, shard_bytes(job="")), grpc.StatusCode.INVALID_ARGUMENT,
     "job is empty"),
    (HELLO_OK + frame(SHARD, shard_bytes(rank=3, world_size=2)),
     grpc.StatusCode.INVALID_ARGUMENT, "rank 3 is not below world_size 2"),
])
def test_bad_input_ends_the_connection_with_a_status_naming_it(daemon, payload, code, words):
    frames = raw_session(daemon.address, payload)
    got_code, message = status_of(frames)
    assert got_code == code.value[0], (got_code, message)
    assert words in message
    assert bytes_held(daemon.address) == 0


def test_in_band_errors_and_half_close(daemon):
    """A failed chunk is a reply with error_code; the stream carries on, and a
    half-close is answered with the open results, then STATUS OK."""
    payload = HELLO_OK + frame(SHARD, shard_bytes(key="bad", world_size=2, values=(1.0, 2.0)))
    payload += frame(SHARD, shard_bytes(key="bad", rank=1, world_size=2, values=(1.0,)))
    payload += frame(SHARD, shard_bytes(key="good", values=(3.0, 4.0)))
    frames = raw_session(daemon.address, payload)
    assert status_of(frames) == (0, "")
    assert all(kind == SHARD for kind, _ in frames[:-1])
    replies = [decode_shard(p) for _, p in frames[:-1]]
    bad = [r for r in replies if r.key == "bad"]
    good = [r for r in replies if r.key == "good"]
    # 2 elements against 1 for one chunk: told in-band, once (replies are per
    # chunk, and both ranks sent on this one stream).
    assert len(bad) == 1 and len(good) == 1
    assert np.frombuffer(good[0].data, "<f2").tolist() == [3.0, 4.0]
    assert bad[0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "rank 1 sent length 1 but rank 0 sent length 2" in bad[0].error_message


def test_a_connection_cut_mid_frame_leaves_the_daemon_well(daemon):
    host = daemon.address.rpartition(":")[0]
    with socket.create_connection((host, data_port(daemon.address)), timeout=10) as sock:
        sock.sendall(HELLO_OK + frame(SHARD, shard_bytes(world_size=2))[:-3])
    time.sleep(0.2)
    assert bytes_held(daemon.address) == 0  # the partial shard never reached the table
    with ReducerClient([daemon.address], job="after", rank=0, world_size=1) as client:
        assert client.allreduce(np.ones(4, dtype=np.float32), "k").tolist() == [1] * 4


def test_a_taken_data_port_stops_the_daemon_with_a_clear_error(tmp_path):
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "reducerd", "--listen", "127.0.0.1:0",
                               "--data-listen", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert f"cannot serve: data plane: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def open_streams(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ReducerStub(channel).GetStatus(pb.StatusRequest(brief=True),
                                                      timeout=5).open_streams


def test_shards_before_a_bad_frame_are_all_answered(daemon):
    """The shards already read when a bad frame arrives still get their
    replies, then the status; none is dropped (tried a few times: a race)."""
    for attempt in range(5):
        good = b"".join(frame(SHARD, shard_bytes(key=f"k{attempt}-{i}")) for i in range(6))
        frames = raw_session(daemon.address, HELLO_OK + good + frame(HELLO, b""))
        assert status_of(frames)[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        keys = sorted(decode_shard(p).key for _, p in frames[:-1])
        assert keys == sorted(f"k{attempt}-{i}" for i in range(6)), frames


def test_a_client_that_does_not_read_is_slowed_then_cut_off(daemon):
    """Replies it does not read pause the daemon's reader (TCP pushes back, no
    unbounded buffering); a send without progress for the round timeout (3 s
    here) ends the connection and frees everything."""
    host = daemon.address.rpartition(":")[0]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, data_port(daemon.address)))
    sock.settimeout(2.0)
    values = np.ones(16 << 10, dtype=np.float32)  # 32 KiB on the wire, answered at once
    sent = 0
    try:
        sock.sendall(HELLO_OK)
        for i in range(4000):  # 128 MiB of shards, if nothing pushed back
            sock.sendall(frame(SHARD, shard_bytes(key=f"k{i}", values=values)))
            sent += 1
    except TimeoutError:
        pass
    assert 0 < sent < 4000  # the daemon stopped reading
    assert open_streams(daemon.address) == 1
    deadline = time.monotonic() + 3 + 5 + 5  # send timeout + linger + slack
    while open_streams(daemon.address) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_streams(daemon.address) == 0
    assert bytes_held(daemon.address) == 0
    sock.close()
    with ReducerClient([daemon.address], job="after", rank=0, world_size=1) as client:
        assert client.allreduce(np.ones(4, dtype=np.float32), "k").tolist() == [1] * 4


def test_chunks_sent_directly_and_their_rests_arrive_whole(daemon_big):
    """A chunk whose link's sender is idle leaves from the caller's thread in one
    non-blocking send (transport/base.py: direct sends); what the socket does
    not take (a 4 MiB chunk against TCP_NOTSENT_LOWAT's 128 KiB) goes first
    through the sender. Sums stay exact either way. The Python path's own
    mechanism: the C loop is off (REDUCER_CLIENT_C_LOOP=0)."""
    from concurrent.futures import ThreadPoolExecutor

    world = 2

    def rank(r: int) -> tuple[list[np.ndarray], int, int]:
        with ReducerClient([daemon_big.address], job="direct", rank=r, world_size=world,
                           wire_dtype="float32", data_plane="tcp", chunk_bytes=4 << 20,
                           timeout=30, environ={"REDUCER_CLIENT_C_LOOP": "0"}) as client:
            results = [client.allreduce(np.full(1001, r + i, np.float32), f"small-{i}", "sum")
                       for i in range(20)]
            big = np.arange(1 << 20, dtype=np.float32) * (r + 1)
            results += [client.allreduce(big, "big", "sum") for _ in range(3)]
            link = client._links[0]
            return results, link.direct_sends, link.direct_rests

    with ThreadPoolExecutor(world) as pool:
        outcomes = list(pool.map(rank, range(world)))
    expected = [np.full(1001, 2 * i + 1, np.float32) for i in range(20)]
    expected += [np.arange(1 << 20, dtype=np.float32) * 3] * 3
    for results, sends, rests in outcomes:
        for got, want in zip(results, expected, strict=True):
            np.testing.assert_array_equal(got, want)
        assert sends >= 10 and rests >= 1, (sends, rests)


@pytest.fixture
def daemon_big(tmp_path):
    d = start_daemon("--round-timeout", "10", log_dir=tmp_path)
    yield d
    d.stop()


def _recv_frames(sock: socket.socket, count: int, deadline_s: float) -> list[tuple[int, bytes]]:
    """Read until `count` whole frames came (or the daemon closed, or the deadline)."""
    from raw_frames import split_frames

    received = bytearray()
    while time.monotonic() < deadline_s:
        frames, _ = split_frames(bytes(received))
        if len(frames) >= count:
            return frames
        sock.settimeout(max(0.05, deadline_s - time.monotonic()))
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        received += chunk
    return split_frames(bytes(received))[0]


def test_a_payload_in_parts_then_idle_longer_than_the_frame_timeout_is_still_served(daemon):
    """A payload that arrives in parts sets the connection's receive tick (the
    frame timeout's clock); it is kept from frame to frame and cleared once the
    connection is idle. An idle wait for the next header has no deadline: after
    4 s (the frame timeout is 3 s here) a frame sent in parts is served again."""
    host = daemon.address.rpartition(":")[0]
    with socket.create_connection((host, data_port(daemon.address)), timeout=10) as sock:
        sock.sendall(HELLO_OK)
        for i, pause_s in enumerate((0.0, 4.0)):
            time.sleep(pause_s)
            whole = frame(SHARD, shard_bytes(key=f"parts-{i}", values=np.arange(4096.0)))
            sock.sendall(whole[:1000])
            time.sleep(0.4)  # more than one receive tick inside the payload
            sock.sendall(whole[1000:])
            replies = _recv_frames(sock, 1, time.monotonic() + 5)
            assert [k for k, _ in replies] == [SHARD], replies
            reply = decode_shard(replies[0][1])
            assert reply.key == f"parts-{i}"
            got = np.frombuffer(reply.data, "<f2").astype(np.float64)
            assert np.array_equal(got, np.arange(4096.0).astype(np.float16))


def test_a_payload_trickled_past_the_frame_timeout_ends_the_connection(daemon):
    """Frame timeout 3 s: a payload trickled a few bytes at a time (each read
    well within it) still ends the connection with DEADLINE_EXCEEDED within
    the timeout of its header plus a tick, also after an earlier payload in
    parts left the tick set."""
    host = daemon.address.rpartition(":")[0]
    with socket.create_connection((host, data_port(daemon.address)), timeout=10) as sock:
        first = frame(SHARD, shard_bytes(key="first", values=np.ones(2048)))
        sock.sendall(HELLO_OK + first[:500])
        time.sleep(0.4)
        sock.sendall(first[500:])
        assert [k for k, _ in _recv_frames(sock, 1, time.monotonic() + 5)] == [SHARD]
        trickled = frame(SHARD, shard_bytes(key="slow", values=np.ones(2048)))
        sock.sendall(trickled[:100])
        started = time.monotonic()
        frames: list[tuple[int, bytes]] = []
        for offset in range(100, len(trickled), 8):
            if time.monotonic() - started > 8:  # the daemon should have ended it by now
                break
            try:
                sock.sendall(trickled[offset:offset + 8])
            except OSError:  # the daemon ended the connection
                break
            sock.settimeout(0.3)
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            frames = _recv_frames_from(data, sock)
            break
        elapsed = time.monotonic() - started
        assert frames and status_of(frames)[0] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], frames
        assert "did not arrive within 3 s of its header" in status_of(frames)[1]
        assert 2.5 < elapsed < 3 + 2, elapsed


def _recv_frames_from(first: bytes, sock: socket.socket) -> list[tuple[int, bytes]]:
    """The frames of `first` and whatever follows until the daemon closes."""
    from raw_frames import split_frames

    received = bytearray(first)
    sock.settimeout(5)
    try:
        while first and (chunk := sock.recv(1 << 16)):
            received += chunk
    except OSError:
        pass
    return split_frames(bytes(received))[0]
