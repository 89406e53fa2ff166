"""Client side of the deploy checks, run by the host's interpreter inside a
machine's network namespace (`nsenter --net=/proc/PID/ns/net python netns_probe.py ...`).

    watch-health ADDRESS          health checks back to back until stdin closes, then
                                  one JSON line: [[start_s, end_s, status], ...]
                                  (time.monotonic(), the clock systemd's *Monotonic use)
    wait-serving ADDRESS SECONDS  health checks until one answers SERVING (or exit 1)
    status ADDRESS TOKEN          GetStatus without and with the token:
                                  {"without": CODE, "with": CODE}
    drain ADDRESS TOKEN JOB       two chunks open on three streams; after "go" on stdin
                                  the one with a missing rank gets it: JSON of the replies
    allreduce RANK                one float32 allreduce with ReducerClient.from_env(),
                                  checked against a float64 reference; prints "ok RANK"

Every step has a timeout: nothing here waits for ever.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc

STEP_TIMEOUT_S = 30.0


def watch_health(address: str) -> None:
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    attempts = []
    deadline = time.monotonic() + 120
    print("watching", flush=True)
    while not closed.is_set() and time.monotonic() < deadline:
        start = time.monotonic()
        # A new channel each time, as a probe does: a channel whose connection
        # failed waits out its reconnect backoff even once the port answers.
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                status = exc.code().name
        attempts.append([start, time.monotonic(), status])
        time.sleep(0.01)
    print(json.dumps(attempts), flush=True)


def wait_serving(address: str, timeout_s: str) -> None:
    """Health checks (fresh channels, no token) until one answers SERVING."""
    deadline = time.monotonic() + float(timeout_s)
    last = ""
    while time.monotonic() < deadline:
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = exc.code().name
        time.sleep(0.2)
    raise SystemExit(f"{address}: not SERVING after {timeout_s} s (last: {last})")


def _metadata(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def status(address: str, token: str) -> None:
    out = {}
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ReducerStub(channel)
        for name, metadata in (("without", ()), ("with", _metadata(token))):
            try:
                stub.GetStatus(pb.StatusRequest(), timeout=5, metadata=metadata)
                out[name] = "OK"
            except grpc.RpcError as exc:
                out[name] = exc.code().name
    print(json.dumps(out), flush=True)


class _Stream:
    """One Reduce call: shards go in through a queue, replies are read in order."""

    def __init__(self, channel: grpc.Channel, token: str) -> None:
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.call = pb_grpc.ReducerStub(channel).Reduce(iter(self.outbox.get, None),
                                                        metadata=_metadata(token),
                                                        timeout=STEP_TIMEOUT_S)

    def send(self, job: str, rank: int, key: str, values: list[float],
             world_size: int = 2) -> None:
        data = np.asarray(values, dtype="<f4").tobytes()
        self.outbox.put(pb.Shard(job=job, rank=rank, world_size=world_size, round=0, key=key,
                                 offset=0, dtype=pb.DTYPE_FLOAT32, op=pb.REDUCE_OP_SUM,
                                 data=data))

    def reply(self) -> object:
        """The next result's values, or the status code name that ended the call."""
        try:
            return np.frombuffer(next(self.call).data, dtype="<f4").tolist()
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    def close(self) -> None:
        self.outbox.put(None)
        self.call.cancel()


def drain(address: str, token: str, job: str) -> None:
    """Chunk "done" (ranks 0 and 1, rank 1 sent only after "go") and chunk "left"
    (rank 0 only): the first completes during the drain, the second fails at its end."""
    with grpc.insecure_channel(address) as channel:
        done0, done1, left0 = (_Stream(channel, token) for _ in range(3))
        try:
            done1.send(job, 0, "warmup", [5.0], world_size=1)  # opens the stream now
            warmup = done1.reply()
            done0.send(job, 0, "done", [1.0, 2.0])
            left0.send(job, 0, "left", [7.0])
            time.sleep(0.3)  # both chunks open on the daemon
            print(json.dumps({"open": warmup}), flush=True)
            assert sys.stdin.readline().strip() == "go"
            done1.send(job, 1, "done", [10.0, 20.0])
            print(json.dumps({"done0": done0.reply(), "done1": done1.reply(),
                              "left0": left0.reply()}), flush=True)
        finally:
            for stream in (done0, done1, left0):
                stream.close()


def allreduce(rank: int) -> None:
    from reducer_client import ReducerClient

    with ReducerClient.from_env() as client:
        world_size = client.world_size
        values = [np.random.default_rng(r).standard_normal(300_000).astype(np.float32)
                  for r in range(world_size)]
        total = client.allreduce(values[rank], key="deploy/grad", op="sum")
    reference = np.sum(np.stack(values).astype(np.float64), axis=0)
    # float32 wire: each of the world_size - 1 additions rounds once, by at most
    # 2**-24 of the partial sum, which is at most the sum of magnitudes.
    bound = world_size * 2.0 ** -24 * np.sum(np.abs(np.stack(values)), axis=0)
    error = np.abs(total.astype(np.float64) - reference)
    assert np.all(error <= bound), f"rank {rank}: error {error.max():g} above the bound"
    print(f"ok {rank}", flush=True)


def main(argv: list[str]) -> None:
    command, args = argv[0], argv[1:]
    if command == "watch-health":
        watch_health(*args)
    elif command == "wait-serving":
        wait_serving(*args)
    elif command == "status":
        status(*args)
    elif command == "drain":
        drain(*args)
    elif command == "allreduce":
        allreduce(int(args[0]))
    else:
        raise SystemExit(f"netns_probe: unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
