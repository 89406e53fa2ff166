"""Worker functions for the C loop's integration tests (test_client_loop.py).

Each worker allreduces several keys whose chunks span every daemon, after a
first key that lets the client dial its C connections, and returns the
results' bytes and how many keys went through the loop.
"""

from __future__ import annotations

import numpy as np
from core_cases import error_bound, make_input
from reducer_client import ReducerClient
from reducer_wire import dtypes


def several_keys_worker(rank: int, world_size: int, addresses: list[str], keys: int,
                        numel: int, wire: str, in_dtype: str) -> dict:
    dtype = np.dtype(in_dtype)
    with ReducerClient(addresses, job=f"loop-{wire}-{in_dtype}", rank=rank,
                       world_size=world_size, wire_dtype=wire, chunk_bytes=16 << 10,
                       timeout=30) as client:
        client.allreduce(np.ones(16, dtype), key="warm")  # the loop dials meanwhile
        ready = client.c_loop is not None and client.c_loop.wait_ready(10)
        futures = [client.allreduce_async(make_input(7, rank, k, numel, dtype), key=f"k{k}",
                                          priority=k % 2)
                   for k in range(keys)]
        results = [f.result(30) for f in futures]
        for k, result in enumerate(results):
            inputs = [make_input(7, r, k, numel, dtype) for r in range(world_size)]
            reference = np.sum([x.astype(np.float64) for x in inputs], axis=0)
            bound = error_bound(inputs, reference, wire, "sum")
            if dtype == np.float16:  # and the float16 output's own rounding
                bound = bound + np.abs(reference) * 2.0 ** -11 + 2.0 ** -25
            excess = np.abs(result.astype(np.float64) - reference) - bound
            assert (excess <= 0).all(), f"key k{k}: {excess.max()} over the bound"
        wire_dtype = dtypes.WIRE_DTYPES[wire]
        daemons_per_key = [len({c.daemon for c in client._layout.plan(numel, wire_dtype,
                                                                      f"k{k}")})
                           for k in range(keys)]
        return {"ready": ready, "results": [r.tobytes() for r in results],
                "keys_sent": client.c_loop.keys_sent if client.c_loop else 0,
                "frames": client.c_loop.counters()[0] if client.c_loop else 0,
                "daemons_per_key": daemons_per_key}
