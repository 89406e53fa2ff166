"""Faults with real processes: killed workers and daemons, restarts, the daemon's own bugs."""

import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from fault_cases import FAULTY_DAEMON, outlive_daemon_worker, suicidal_worker, training_worker
from raw_frames import HELLO_OK, frame, raw_session, status_of
from reducer_client import ReducerClient
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from reducer_wire.codes import status_code_from_value
from reducer_wire.framing import SHARD
from support import run_workers, start_daemon


def status(address):
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ReducerStub(channel).GetStatus(pb.StatusRequest(), timeout=5)


def wait_for_step(progress_dir: Path, ranks, step, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(int((progress_dir / str(r)).read_text() or -1) >= step for r in ranks):
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError(f"workers did not reach step {step}")


def test_daemon_killed_and_restarted_training_matches_a_fault_free_run(tmp_path):
    """SIGKILL one of two daemons mid-training and restart it on the same port:
    the clients reconnect and resend, nothing is counted twice, and the final
    parameters equal a fault-free run's bit for bit."""
    steps, world = 30, 3
    daemons = [start_daemon("--round-timeout", "20", log_dir=tmp_path) for _ in range(2)]
    try:
        addresses = [d.address for d in daemons]
        clean_dir = tmp_path / "clean"
        clean_dir.mkdir()
        clean = run_workers(training_worker, world, (addresses, steps, str(clean_dir)))

        fault_dir = tmp_path / "fault"
        fault_dir.mkdir()
        results = {}
        runner = threading.Thread(target=lambda: results.update(out=run_workers(
            training_worker, world, (addresses, steps, str(fault_dir), 0.05), timeout=120)))
        runner.start()
        wait_for_step(fault_dir, range(world), 8)
        port = int(daemons[1].address.rsplit(":", 1)[1])
        daemons[1].stop(signal.SIGKILL)
        time.sleep(0.3)
        daemons[1] = start_daemon("--round-timeout", "20", log_dir=tmp_path, port=port)
        runner.join(150)
        assert not runner.is_alive()
    finally:
        for d in daemons:
            d.stop()
    faulted = results["out"]
    assert sum(int.from_bytes(r[-4:], "little") for r in faulted) >= world  # all reconnected
    for rank in range(world):
        params = np.frombuffer(faulted[rank][:-4], dtype=np.float32)
        assert np.array_equal(params, np.frombuffer(clean[rank][:-4], dtype=np.float32))
    assert len({r[:-4] for r in faulted}) == 1


def test_worker_killed_mid_round(tmp_path):
    """Rank 2 dies with SIGKILL mid-round: ranks 0 and 1 get DEADLINE_EXCEEDED
    naming rank 2 within the round timeout + 1 s, and the daemons free the round."""
    round_timeout = 2.0
    daemons = [start_daemon("--round-timeout", str(round_timeout), log_dir=tmp_path)
               for _ in range(2)]
    try:
        addresses = [d.address for d in daemons]
        results = run_workers(suicidal_worker, 3, (addresses, 2, round_timeout),
                              allow_errors=True)
        for result in results[:2]:
            code, message = result["error"]
            assert code == "DEADLINE_EXCEEDED" and "rank(s) 2 of 3" in message
            assert result["elapsed"] < round_timeout + 1.0
        assert "died without a result" in str(results[2])
        time.sleep(0.5)
        for d in daemons:
            reply = status(d.address)
            assert reply.bytes_held == 0
            assert all(job.open_chunks == 0 for job in reply.jobs)
    finally:
        for d in daemons:
            d.stop()


def test_daemon_that_never_comes_back(tmp_path):
    """Both daemons are killed for good: every worker's next allreduce fails
    with UNAVAILABLE naming a daemon, within its timeout, and nothing hangs."""
    daemons = [start_daemon(log_dir=tmp_path) for _ in range(2)]
    results = {}
    runner = threading.Thread(target=lambda: results.update(out=run_workers(
        outlive_daemon_worker, 2, ([d.address for d in daemons], str(tmp_path)),
        timeout=60)))
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / str(r)).exists() for r in range(2)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for d in daemons:
            d.stop(signal.SIGKILL)
        (tmp_path / "killed").write_text("")
        runner.join(60)
    finally:
        for d in daemons:
            d.stop()
    for result in results["out"]:
        code, message = result["error"]
        assert code == "UNAVAILABLE" and "127.0.0.1:" in message
        assert result["elapsed"] < 3 + 1.5


def _boom_shard() -> bytes:
    return pb.Shard(job="boom", key="k", rank=0, world_size=1, dtype=pb.DTYPE_FLOAT16,
                    op=pb.REDUCE_OP_SUM, data=b"\0\x3c" * 4).SerializeToString()


def _reduce_over_grpc(address: str, message: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream("/reducer.v1.Reducer/Reduce")(iter([message]), timeout=20)
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return call.code(), call.details()


def _reduce_over_the_data_plane(address: str, message: bytes) -> tuple[grpc.StatusCode, str]:
    code, details = status_of(raw_session(address, HELLO_OK + frame(SHARD, message), 20))
    return status_code_from_value(code), details


@pytest.mark.parametrize("fault", ["shard_in", "contribute", "delivered"])
def test_a_fault_of_the_daemon_is_internal_and_logged_on_both_transports(tmp_path, fault):
    """The daemon's own code raises (metrics on a shard or a delivery, the
    reduction table): the stream ends with INTERNAL saying it is the daemon's
    fault (not INVALID_ARGUMENT blaming the client), over gRPC and the data
    plane alike; the log has an ERROR line with the traceback; the daemon
    still serves a good job exactly."""
    start = time.monotonic()
    daemon = start_daemon("--metrics-listen", "127.0.0.1:0", "--round-timeout", "5",
                          log_dir=tmp_path, entry=("-c", FAULTY_DAEMON, fault))
    try:
        for transport in (_reduce_over_grpc, _reduce_over_the_data_plane):
            code, details = transport(daemon.address, _boom_shard())
            assert code == grpc.StatusCode.INTERNAL, (transport.__name__, code, details)
            assert "fault of the daemon, not of this client" in details
            assert f"injected fault in {fault}" in details
        with ReducerClient([daemon.address], job="ok", rank=0, world_size=1,
                           timeout=10) as client:
            x = np.arange(1000, dtype=np.float32)
            assert np.array_equal(client.allreduce(x, key="w"), x)
        log = daemon.log()
        errors = [line for line in log.splitlines() if "reducerd fault while" in line]
        assert len(errors) >= 2 and all("ERROR" in line for line in errors), log
        assert log.count(f"RuntimeError: injected fault in {fault}") >= 2
        assert "Traceback (most recent call last)" in log
        assert "cannot read the stream" not in log
    finally:
        daemon.stop()
    assert time.monotonic() - start < 60
