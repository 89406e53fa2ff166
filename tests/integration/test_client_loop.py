"""The client's C loop (fastpath.py) with real daemons on 127.0.0.1.

Scenarios: several keys from two worker processes whose chunks span three
daemons, on the loop and on the Python path (REDUCER_CLIENT_C_LOOP=0), with
the same bits; one data connection per worker carrying both paths' keys; a
connection refused for capacity (gRPC on both paths); an in-band error, a
round timeout, a token refused and a daemon killed while a key waits on it
(the Python path's error, in bounded time, never a hang); the switches that
keep the Python path.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import numpy as np
import pytest
from loop_cases import several_keys_worker
from reducer_client import ReducerClient, ReducerError, fastpath
from reducer_client.transport.tcp import dial
from support import limited_daemon, run_workers, start_daemon

from reducerd.service.access import job_token

pytestmark = pytest.mark.skipif(not fastpath.available(), reason="the C loop was not built")

OFF = {"REDUCER_CLIENT_C_LOOP": "0"}
ON = {"REDUCER_CLIENT_C_LOOP": "1"}


@pytest.fixture(autouse=True)
def _c_loop_on(monkeypatch):
    """The C loop is the default: on for these tests and their workers even
    where the suite runs with REDUCER_CLIENT_C_LOOP=0."""
    monkeypatch.setenv("REDUCER_CLIENT_C_LOOP", "1")


def _caps(connections: int) -> str:
    return f"import reducerd.dataplane.plane as d; d.MAX_CONNECTIONS = {connections}"


@pytest.mark.parametrize("wire, in_dtype", [("float16", "float32"), ("bfloat16", "float16"),
                                            ("float32", "float32")])
def test_several_keys_over_three_daemons_on_the_loop_and_in_python(daemons, wire, in_dtype):
    """Every key after the first goes through the loop; its chunks reach all
    three daemons; the sums are within the float64 bound and bit for bit the
    Python path's (two workers: a + b == b + a)."""
    with daemons(3) as d:
        on = run_workers(several_keys_worker, 2, (d.addresses, 6, 30_000, wire, in_dtype),
                         timeout=90)
        off = run_workers(several_keys_worker, 2, (d.addresses, 6, 30_000, wire, in_dtype),
                          timeout=90, env=OFF)
    for result in on:
        assert result["ready"] and result["keys_sent"] == 6
        assert result["frames"] >= 6 * 3
        assert min(result["daemons_per_key"]) == 3
    assert on[0]["results"] == on[1]["results"]
    for result in off:
        assert not result["ready"] and result["keys_sent"] == 0
    assert on[0]["results"] == off[0]["results"]


def clients(addresses, job, world_size=2, environ=None, **kw):
    return [ReducerClient(addresses, job=job, rank=r, world_size=world_size, timeout=3,
                          environ=environ if environ is not None else {}, **kw)
            for r in range(world_size)]


def warm(pair, key="warm"):
    """One allreduce on every client (threads), then wait for the loops' connections."""
    futures = [c.allreduce_async(np.ones(8, np.float32), key=key) for c in pair]
    for f in futures:
        f.result(10)
    for c in pair:
        assert c.c_loop is None or c.c_loop.wait_ready(10)


def error_of(future) -> ReducerError:
    with pytest.raises(ReducerError) as info:
        future.result(20)
    return info.value


def test_an_inband_error_fails_the_key_as_on_the_python_path(tmp_path):
    """Rank 1 sends one element more: the daemon answers the chunk with an
    error, and both paths fail the key with the same code and message."""
    d = start_daemon("--round-timeout", "3", log_dir=tmp_path)
    try:
        errors = {}
        for name, environ in (("loop", ON), ("python", OFF)):
            pair = clients([d.address], f"err-{name}", environ=environ)
            try:
                warm(pair)
                keys_before = pair[0].c_loop.keys_sent if pair[0].c_loop else 0
                futures = [c.allreduce_async(np.ones(100 + r, np.float32), key="bad")
                           for r, c in enumerate(pair)]
                errors[name] = [error_of(f) for f in futures]
                if name == "loop":
                    assert pair[0].c_loop.keys_sent == keys_before + 1
                good = [c.allreduce_async(np.full(10, 1.0, np.float32), key="good")
                        for c in pair]
                assert [f.result(10).tolist() for f in good] == [[2.0] * 10] * 2
            finally:
                for c in pair:
                    c.close()
    finally:
        d.stop()
    for loop_error, python_error in zip(errors["loop"], errors["python"], strict=True):
        assert loop_error.code == python_error.code
        assert _arrival_free(str(loop_error).replace("err-loop", "JOB")) == \
            _arrival_free(str(python_error).replace("err-python", "JOB"))
        assert "'bad'" in str(loop_error)


def _arrival_free(message):
    """The daemon names the rank that opened the chunk first ("rank A sent length
    X but rank B sent length Y"), which is arrival order: compare the pair sorted."""
    match = re.search(r"(rank \d+ sent length \d+) but (rank \d+ sent length \d+)", message)
    if match is None:
        return message
    pair = " but ".join(sorted(match.groups()))
    return message[:match.start()] + pair + message[match.end():]


def test_a_daemon_killed_mid_key_fails_as_on_the_python_path(tmp_path):
    """Rank 0 sends a key rank 1 never sends, so its chunks wait on both
    daemons; one daemon is killed. The key fails within its timeout plus a
    margin with the Python path's error (code and wording), never hangs."""
    outcomes = {}
    for name, environ in (("loop", ON), ("python", OFF)):
        ds = [start_daemon("--round-timeout", "30", log_dir=tmp_path)
              for i in range(2)]
        pair = clients([x.address for x in ds], f"die-{name}", environ=environ,
                       chunk_bytes=4096)
        try:
            warm(pair)
            start = time.monotonic()
            future = pair[0].allreduce_async(np.ones(20_000, np.float32), key="k")
            if name == "loop":
                assert pair[0].c_loop.keys_sent == 1  # this key: the warm one went in Python
            time.sleep(0.3)  # its chunks wait at the daemons for rank 1
            ds[1].process.kill()
            ds[1].process.wait()
            error = error_of(future)
            outcomes[name] = (error, time.monotonic() - start, ds[1].address)
        finally:
            for c in pair:
                c.close()
            for x in ds:
                x.stop(signal.SIGKILL)  # the open round would hold SIGTERM's grace
    (loop_error, loop_s, loop_addr), (py_error, py_s, py_addr) = outcomes["loop"], \
        outcomes["python"]
    assert loop_s < 3 + 2.0 and py_s < 3 + 2.0
    assert loop_error.code == py_error.code
    assert loop_error.retryable == py_error.retryable
    # Both name the dead daemon. The wording is the link's own ("daemon A:
    # status: ...") where its resend failed before the key's timeout, else the
    # timeout's ("cannot reach daemon(s) A ..."): which comes first is timing,
    # on either path (seen under load on the loop's).
    assert loop_addr in str(loop_error) and py_addr in str(py_error), \
        (str(loop_error), str(py_error))


def test_the_switches_keep_the_python_path(tmp_path, monkeypatch):
    """REDUCER_CLIENT_C_LOOP=0, REDUCER_WIRE_NUMPY=1, gRPC, and an extension that
    was not built: no loop, every key on the Python path, same results."""
    d = start_daemon(log_dir=tmp_path)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(fastpath, "_tcploop", None)  # as where no compiler was at hand
            assert not fastpath.available()
            with ReducerClient([d.address], job="unbuilt", rank=0, world_size=1,
                               wire_dtype="float32", environ={}) as client:
                assert client.c_loop is None
                for _ in range(3):
                    got = client.allreduce(np.arange(5000, dtype=np.float32), key="k")
                    assert got.tolist() == np.arange(5000, dtype=np.float32).tolist()
        for environ in (OFF, {"REDUCER_WIRE_NUMPY": "1"}):
            with ReducerClient([d.address], job="off", rank=0, world_size=1,
                               environ=environ) as client:
                assert client.c_loop is None
                assert client.allreduce(np.ones(4, np.float32), key="k").tolist() == [1.0] * 4
        with ReducerClient([d.address], job="grpc", rank=0, world_size=1,
                           data_plane="grpc", environ={}) as client:
            assert client.c_loop is None
    finally:
        d.stop()


def test_close_with_keys_in_flight_on_the_loop_is_bounded(tmp_path):
    d = start_daemon(log_dir=tmp_path)
    try:
        pair = clients([d.address], "close")
        warm(pair)
        future = pair[0].allreduce_async(np.ones(50_000, np.float32), key="open")
        closed = threading.Event()
        threading.Thread(target=lambda: (pair[0].close(), closed.set()), daemon=True).start()
        assert closed.wait(5)
        assert error_of(future).code.name == "CANCELLED"
        pair[1].close()
    finally:
        d.stop()


def _exact_input(rank: int, numel: int, dtype) -> np.ndarray:
    """Small integers: every path's sum is exact, equal to the float64 reference."""
    return ((np.arange(numel) % 31) + 10 * rank).astype(dtype)


def test_one_data_connection_per_worker_carries_both_paths(tmp_path):
    """A daemon that takes two data connections in all serves two workers with
    the loop on: the loop's keys and the Python path's (float64, int32) share
    each worker's one connection, concurrently, and every sum is exact."""
    d = limited_daemon(log_dir=tmp_path, prelude=_caps(2))
    try:
        pair = clients([d.address], "one-conn", data_plane="tcp", chunk_bytes=4096)
        try:
            warm(pair)
            assert all(c.c_loop.ready for c in pair)
            dtypes_ = (np.float32, np.float64, np.int32, np.float16, np.float64)
            futures = [[c.allreduce_async(_exact_input(r, 9000, dt), key=f"k{i}")
                        for i, dt in enumerate(dtypes_)] for r, c in enumerate(pair)]
            for per_rank in futures:
                for i, dt in enumerate(dtypes_):
                    expected = sum(_exact_input(r, 9000, np.float64) for r in range(2))
                    got = per_rank[i].result(20)
                    assert got.dtype == dt
                    np.testing.assert_array_equal(got, expected.astype(dt))
            for c in pair:
                assert c.c_loop.keys_sent == 2  # float32 and float16; the rest in Python
                assert c.transports == ["tcp"] and c.links[0].reconnects == 0
        finally:
            for c in pair:
                c.close()
        assert "too many data connections" not in d.log()
    finally:
        d.stop()


def test_a_connection_refused_for_capacity_sends_through_grpc_on_both_paths(tmp_path):
    """The daemon's only data connection is taken: both paths' workers are
    refused, send through gRPC instead (exact sums), and the loop carries no key."""
    d = limited_daemon(log_dir=tmp_path, prelude=_caps(1))
    try:
        probe = ReducerClient([d.address], job="probe", rank=0, world_size=1, environ=OFF)
        port = probe.links[0].route()[0].brief_status().data_port
        probe.close()
        holder, _ = dial("127.0.0.1", port, "", 5)
        try:
            time.sleep(0.3)  # its handshake is in: it holds the one connection
            for name, environ in (("loop", ON), ("python", OFF)):
                pair = clients([d.address], f"refused-{name}", environ=environ)
                try:
                    futures = [c.allreduce_async(_exact_input(r, 5000, np.float32), key="k")
                               for r, c in enumerate(pair)]
                    expected = sum(_exact_input(r, 5000, np.float64) for r in range(2))
                    for f in futures:
                        np.testing.assert_array_equal(f.result(10), expected)
                    for c in pair:
                        assert c.transports == ["grpc"]
                        assert c.c_loop is None or (c.c_loop.keys_sent == 0
                                                    and not c.c_loop.ready)
                finally:
                    for c in pair:
                        c.close()
            assert "too many data connections (1)" in d.log()
        finally:
            holder.close()
    finally:
        d.stop()


def _lone_key_error(environ, job: str, address: str, warm_up: bool = True,
                    on_loop: bool = True, **kw) -> tuple[ReducerError, float]:
    """Rank 0 of two sends a key alone, on the loop where it is on (unless
    on_loop says no connection can be had): the error it fails with, and how
    long that took. warm_up=False: a first key that fails too opens the
    connections instead of an allreduce of both ranks."""
    pair = clients([address], job, environ=environ, **kw)
    try:
        if warm_up:
            warm(pair)
        else:
            error_of(pair[0].allreduce_async(np.ones(8, np.float32), key="first"))
            if pair[0].c_loop is not None:
                assert pair[0].c_loop.wait_ready(10 if on_loop else 0.5) == on_loop
        start = time.monotonic()
        future = pair[0].allreduce_async(np.ones(20_000, np.float32), key="alone")
        if environ is ON:
            assert pair[0].c_loop.keys_sent == int(on_loop)
        return error_of(future), time.monotonic() - start
    finally:
        for c in pair:
            c.close()


def test_a_round_timeout_fails_the_key_as_on_the_python_path(tmp_path):
    """Rank 1 never sends the key: the daemon's round timeout (1 s) fails it
    with the same code and words on both paths, before the client's own."""
    d = start_daemon("--round-timeout", "1", log_dir=tmp_path)
    try:
        outcomes = {name: _lone_key_error(environ, f"late-{name}", d.address)
                    for name, environ in (("loop", ON), ("python", OFF))}
    finally:
        d.stop()
    (loop_error, loop_s), (python_error, python_s) = outcomes["loop"], outcomes["python"]
    assert loop_error.code == python_error.code
    assert str(loop_error).replace("late-loop", "JOB") == \
        str(python_error).replace("late-python", "JOB")
    assert loop_s < 3 and python_s < 3  # the daemon's 1 s, not the client's 3 s


@pytest.mark.parametrize("token", ["not-the-token", "another job's"])
def test_a_token_refused_fails_as_on_the_python_path(tmp_path, token):
    """A token the daemon does not know (refused at its status: no
    connection, no loop) or another job's (the data plane refuses its
    shards, on the loop's connection): both paths fail the key with the same
    code and words, in bounded time."""
    token_file = tmp_path / "token"
    token_file.write_text("the-daemon-token\n")
    on_loop = token == "another job's"
    if on_loop:
        token = job_token("the-daemon-token", "other")
    d = start_daemon("--auth-token-file", str(token_file), log_dir=tmp_path)
    try:
        outcomes = {name: _lone_key_error(environ, "job", d.address, token=token,
                                          data_plane="tcp", warm_up=False, on_loop=on_loop)
                    for name, environ in (("loop", ON), ("python", OFF))}
    finally:
        d.stop()
    (loop_error, loop_s), (python_error, python_s) = outcomes["loop"], outcomes["python"]
    assert loop_error.code == python_error.code, (loop_error, python_error)
    assert str(loop_error) == str(python_error)
    assert loop_s < 3 + 2.0 and python_s < 3 + 2.0


def test_a_key_reduced_again_reuses_its_frames_and_keeps_its_last_round(tmp_path):
    """Round after round of one key on the loop: the frames of the round
    before last are the next round's (no fresh pages per round: the client's
    minor page faults stay far below the frames' pages), and the last
    completed round is kept for a restarted daemon (fastpath._remember)."""
    import resource

    d = start_daemon(log_dir=tmp_path)
    try:
        with ReducerClient([d.address], job="reuse", rank=0, world_size=1,
                           wire_dtype="float16", data_plane="tcp", environ=ON) as client:
            assert client.c_loop is not None
            # Frames of 34 MiB: above glibc's largest mmap threshold (32 MiB), so
            # that frames made anew would be fresh pages every round.
            values = np.arange(17 << 20, dtype=np.float32) % 1000
            out = np.empty_like(values)
            client.allreduce(values, key="k", out=out)
            assert client.c_loop.wait_ready(10)
            for _ in range(3):  # the loop's rounds begin; the spares are made
                client.allreduce(values, key="k", out=out)
            rounds, before = 8, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(rounds):
                client.allreduce(values, key="k", out=out)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            np.testing.assert_array_equal(out, values)
            frame_pages = values.size * 2 // resource.getpagesize()
            assert faults < rounds * frame_pages // 8, (faults, frame_pages)
            assert client.c_loop.keys_sent >= rounds + 3
            assert client.c_loop._done["k"].round == client._rounds["k"] - 1
    finally:
        d.stop()
