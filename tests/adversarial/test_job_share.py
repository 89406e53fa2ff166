"""Probe: one job that never reads its replies cannot take the memory every job shares.

Each stream stops reading at 16 MiB of unsent replies, but a job could open
as many streams as it liked: 3 data-plane connections and a gRPC call that
never read asked for 64 MiB of replies and held the whole 64 MiB limit, so
another job's next chunk was refused with RESOURCE_EXHAUSTED at once, and
each further stream added 16 MiB more. Now a job's receive buffers and
unsent replies come to half the limit at most (reducerd.core.limits.
JOB_TRANSPORT_SHARE): every stream of that job waits for its share to come
free, a new stream of it is refused while it holds its share
(RESOURCE_EXHAUSTED before any reply, which clients retry), and the other
half is the others'. The greedy job's streams stay open through the good
job (the probe checks that it really ran beside them), then end at the
round timeout, and everything is given back.
"""

import threading
import time

import grpc
import numpy as np
import pytest
from probes import (
    RSS_SLACK,
    MiB,
    assert_alive,
    data_port,
    data_socket,
    get_status,
    good_job,
    job_status,
    limited_daemon,
    read_status_frame,
    rss_bytes,
    shard,
    wait_until,
)
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.framing import SHARD, frame_header

LIMIT = 64 * MiB
SHARE = LIMIT // 2
FRAME = 4 * MiB
CONNECTIONS = 3
THREADS = 2
# Over the share at most: a frame per summing thread (a chunk between its data
# given back and its reply counted) and a message per gRPC call (read while
# the job was under its share, of a size known only once read).
OVERSHOOT = THREADS * FRAME + MiB
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _frame(key: str, round_: int, nbytes: int = FRAME) -> bytes:
    """A single-rank shard of the greedy job: each one makes a reply as large."""
    message = shard("greedy", 0, 1, np.ones(nbytes // 4, np.float32), key=key,
                    round_=round_).SerializeToString()
    return frame_header(SHARD, len(message)) + message


def _flood(sock, key: str) -> None:
    """Send shards until the daemon stops reading (the first one went already)."""
    sock.settimeout(2.0)
    try:
        for round_ in range(1, 40):
            sock.sendall(_frame(key, round_))
    except (TimeoutError, OSError):
        pass


def _grpc_call(channel, key: str, nbytes: int = MiB):
    def requests():
        for round_ in range(100):
            yield shard("greedy", 0, 1, np.ones(nbytes // 4, np.float32), key=key,
                        round_=round_)

    return channel.stream_stream("/reducer.v1.Reducer/Reduce",
                                 request_serializer=pb.Shard.SerializeToString)(requests())


def test_a_job_that_never_reads_keeps_to_its_share_of_the_limit(tmp_path):
    daemon = limited_daemon("--max-inflight-bytes", str(LIMIT), "--round-timeout", "8",
                            "--threads", str(THREADS), "--pool-busy-cores", "0", log_dir=tmp_path)
    socks, channels, calls = [], [], []
    try:
        port = data_port(daemon.address)
        before = rss_bytes(daemon)
        # Every stream's first shard is in before the job fills its share.
        socks = [data_socket(daemon.address, port=port) for _ in range(CONNECTIONS)]
        for i, sock in enumerate(socks):
            sock.sendall(_frame(f"c{i}", 0))
        channels.append(grpc.insecure_channel(daemon.address))
        calls.append(_grpc_call(channels[0], "g0"))
        assert wait_until(
            lambda: job_status(daemon, "greedy").chunks_completed >= CONNECTIONS + 1, 10)
        floods = [threading.Thread(target=_flood, args=(s, f"c{i}"))
                  for i, s in enumerate(socks)]
        for t in floods:
            t.start()
        for t in floods:
            t.join(30)
        assert wait_until(lambda: get_status(daemon.address).bytes_held >= SHARE - FRAME, 5)
        time.sleep(0.5)  # nothing more comes in: every stream of the job waits
        status = get_status(daemon.address)
        assert status.open_streams == CONNECTIONS + 1
        # At its share (was the whole limit, 60 MiB and more).
        assert SHARE - FRAME <= status.bytes_held <= SHARE + OVERSHOOT, status.bytes_held
        # Its streams wait at the share: the daemon gives back what its heaps
        # hold free (memory.HeapTrimmer, once a second; before, RSS stayed up
        # to 40 MiB higher, over this bound in 2 runs of 6 under load).
        bound = SHARE + OVERSHOOT + RSS_SLACK
        wait_until(lambda: rss_bytes(daemon) - before < bound, 5)
        grown = rss_bytes(daemon) - before
        assert grown < bound, f"RSS +{grown / MiB:.0f} MiB"

        # A further stream of the job is refused before it adds anything, on both
        # planes (a first shard of 2 frames: over the share from SHARE - FRAME on).
        late = data_socket(daemon.address, port=port)
        late.sendall(_frame("late", 0, 2 * FRAME))
        code, message = read_status_frame(late)
        late.close()
        assert code == RESOURCE_EXHAUSTED.value[0] and "its share" in message, message
        channels.append(grpc.insecure_channel(daemon.address))
        with pytest.raises(grpc.RpcError) as refused:
            next(_grpc_call(channels[1], "g1", 2 * FRAME))
        assert refused.value.code() == RESOURCE_EXHAUSTED, refused.value
        assert "no new stream of it until they read" in refused.value.details()

        good_job([daemon.address], size=1 << 18, timeout=5)  # 1 MiB per rank: served exactly
        # ...beside the greedy job's streams, still open and still unread.
        status = get_status(daemon.address)
        assert status.open_streams >= CONNECTIONS + 1 and status.bytes_held >= SHARE - FRAME

        # Nothing taken for the round timeout: they end, and all of it is given back.
        assert wait_until(lambda: get_status(daemon.address).bytes_held == 0, 20)
        assert_alive(daemon)
    finally:
        for s in socks:
            s.close()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
        daemon.stop()

