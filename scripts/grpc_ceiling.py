"""What gRPC Python itself costs: an echo server with the daemon's message sizes.

    python scripts/grpc_ceiling.py [--clients 4] [--mib 32] [--message-kib 1024] [--rounds 5]
                                   [--sync]

A grpc.aio server (--sync: the thread-pool server) on 127.0.0.1, in its own
process like reducerd, echoes every raw-bytes message of a bidirectional
stream; each client process streams --mib MiB in --message-kib messages and
reads them back, --rounds times.
Printed: the server's input GB per CPU-second and the wall time per round,
the ceiling for reducerd's daemon (which does the same I/O plus the sums),
to compare with `reducerd bench`'s "daemons: GB of input per CPU-second".
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time

import grpc

from reducerd.bench.procs import cpu_seconds

METHOD = "/echo.Echo/Stream"


def serve_sync(port_queue: mp.Queue) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def echo(request_iterator, context):
        yield from request_iterator

    server = grpc.server(ThreadPoolExecutor(max_workers=32),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "echo.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)}),))
    port_queue.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def serve(port_queue: mp.Queue) -> None:
    async def echo(request_iterator, context):
        async for message in request_iterator:
            yield message

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "echo.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)}),))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def client(port: int, mib: int, message_kib: int, rounds: int, barrier, out: mp.Queue) -> None:
    payload = os.urandom(message_kib << 10)
    count = (mib << 10) // message_kib
    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options) as channel:
        stream = channel.stream_stream(METHOD)
        times = []
        for _ in range(rounds):
            barrier.wait()
            start = time.perf_counter()
            received = sum(len(m) for m in stream(iter([payload] * count)))
            times.append(time.perf_counter() - start)
            assert received == count * len(payload)
    out.put(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--message-kib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sync", action="store_true", help="thread-pool server")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    server = ctx.Process(target=serve_sync if args.sync else serve, args=(ports,),
                         daemon=True)
    server.start()
    try:
        port = ports.get(timeout=30)
        out: mp.Queue = ctx.Queue()
        barrier = ctx.Barrier(args.clients)
        cpu_before = cpu_seconds(server.pid)
        clients = [ctx.Process(target=client, args=(port, args.mib, args.message_kib,
                                                    args.rounds, barrier, out))
                   for _ in range(args.clients)]
        for c in clients:
            c.start()
        times = [out.get(timeout=600) for _ in clients]
        for c in clients:
            c.join(30)
        cpu = cpu_seconds(server.pid) - cpu_before
    finally:
        server.kill()
    total_in = args.clients * args.rounds * (args.mib << 20)
    per_round = sorted(max(t[i] for t in times) for i in range(args.rounds))
    kind = "sync" if args.sync else "aio"
    print(f"{kind} echo server: {total_in / 1e9 / cpu:.2f} GB of input per CPU-second "
          f"({total_in / 1e9:.2f} GB in and out, {cpu:.2f} s CPU); "
          f"median round {per_round[len(per_round) // 2] * 1e3:.0f} ms for "
          f"{args.clients} x {args.mib} MiB each way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
