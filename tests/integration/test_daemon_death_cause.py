"""A daemon that dies is named as the cause, not the other daemons' echo of it.

Scenario: two daemons (round timeout 2 s), two ranks (client timeout 12 s).
After a good round, daemon 1 is killed and rank 1 stops (as a rank that met
the error first would). Rank 0 starts a step of several buckets, each cut
over both daemons. Daemon 0 fails its chunks of them at its round timeout
with DEADLINE_EXCEEDED naming the missing rank 1: the echo. Before, that is
what the step raised (after 2 s), while the cause, daemon 1 gone
(UNAVAILABLE, retryable), came only at the client's timeout; shims that
wait for their buckets in order (torch's optimizer.synchronize, the MXNet
kvstore's fused groups, TF's one op per step) reported the echo. Now every
bucket fails with UNAVAILABLE naming daemon 1, at the round timeout.
"""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest
from reducer_client import ReducerClient, ReducerError
from support import running_daemons

pytestmark = pytest.mark.timeout(90)
ROUND_TIMEOUT_S, CLIENT_TIMEOUT_S = 2.0, 12.0
SIZE = 1 << 18  # 1 MiB of float32 per bucket: cut over both daemons


def _client(addresses, rank):
    return ReducerClient(addresses, job="death", rank=rank, world_size=2,
                         wire_dtype="float32", timeout=CLIENT_TIMEOUT_S, node_local=False)


def test_a_step_with_several_buckets_names_the_dead_daemon_not_the_echo(tmp_path):
    with running_daemons(2, "--round-timeout", str(ROUND_TIMEOUT_S),
                         log_dir=tmp_path) as daemons:
        addresses = daemons.addresses
        ranks = [_client(addresses, r) for r in (0, 1)]
        try:
            futures = [ranks[r].allreduce_async(np.full(SIZE, r + 1, np.float32), key="w")
                       for r in (0, 1)]
            for future in futures:
                np.testing.assert_array_equal(future.result(30), np.full(SIZE, 3, np.float32))
            ranks[1].close()
            assert {c.daemon for c in ranks[0]._layout.plan(SIZE, 1, "b0")} == {0, 1}, \
                "a bucket must be cut over both daemons for this scenario"
            daemons.processes[1].stop(signal.SIGKILL)
            start = time.monotonic()
            buckets = [ranks[0].allreduce_async(np.ones(SIZE, np.float32), key=f"b{i}")
                       for i in range(4)]
            errors = []
            for future in buckets:  # in order, as the shims' synchronize waits
                with pytest.raises(ReducerError) as failed:
                    future.result(CLIENT_TIMEOUT_S + 10)
                errors.append((failed.value, time.monotonic() - start))
            first, first_s = errors[0]
            assert first.code == grpc.StatusCode.UNAVAILABLE, first
            assert first.retryable
            assert addresses[1] in str(first), first
            assert first_s < CLIENT_TIMEOUT_S - 4, first_s  # at the round timeout, not later
            assert all(e.code == grpc.StatusCode.UNAVAILABLE for e, _ in errors), errors
        finally:
            for client in ranks:
                client.close()
