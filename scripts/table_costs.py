"""What the reduction table's bookkeeping costs with many contributors (issue 19).

Pure CPU, no sockets: a ReductionTable with K open chunks of a job of W
ranks, each chunk holding W - 1 contributions (one element each, so only the
bookkeeping counts) from W distinct streams, then

- contribute: seconds per contribution while filling the chunks;
- open_chunks(): one call listing every open chunk with its missing ranks
  (at most 64 named each); GetStatus lists at most 100 stalled ones
  (open_chunks(stalled_after, 100)) and a metrics scrape only counts them
  (stalled_count), both timed too;
- drop_sink: all W streams ending while the K chunks are open (a job that
  dies mid-round), each given the chunks it waits for (Stream.waiting), as
  Session.close_stream does.

Per-contribution costs that stay flat as W grows are fine; totals that grow
with W x W x K are what a daemon with hundreds of contributors must avoid.

    .venv/bin/python scripts/table_costs.py --contributors 8,64,256 --chunks 256,1024
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.daemon.grpc_service import STALLED_LISTED_AT_MOST


class _Sink:
    """A stand-in for a Stream (the table only keeps and compares them)."""


def measure(contributors: int, chunks: int) -> dict[str, float]:
    table = ReductionTable(round_timeout_s=600.0, max_inflight_bytes=1 << 34)
    sinks = [_Sink() for _ in range(contributors)]
    waiting: list[set[ChunkId]] = [set() for _ in range(contributors)]
    one = np.ones(1, np.float16).tobytes()
    started = time.perf_counter()
    for chunk in range(chunks):
        cid = ChunkId("job", "key", 0, chunk)
        for rank in range(contributors - 1):  # the last rank never comes: chunks stay open
            table.contribute(cid, Contribution(rank, contributors, pb.DTYPE_FLOAT16,
                                               pb.REDUCE_OP_SUM, one), sinks[rank])
            waiting[rank].add(cid)
    contribute_s = time.perf_counter() - started
    started = time.perf_counter()
    table.open_chunks()
    open_chunks_s = time.perf_counter() - started
    started = time.perf_counter()
    table.open_chunks(0.0, STALLED_LISTED_AT_MOST)
    status_s = time.perf_counter() - started
    started = time.perf_counter()
    table.stalled_count(0.0)
    scrape_s = time.perf_counter() - started
    started = time.perf_counter()
    for sink, chunks_waited in zip(sinks, waiting, strict=True):
        table.drop_sink(sink, chunks_waited)
    drop_s = time.perf_counter() - started
    return {"contribute_us_each": contribute_s / (chunks * (contributors - 1)) * 1e6,
            "open_chunks_ms": open_chunks_s * 1e3, "status_ms": status_s * 1e3,
            "scrape_ms": scrape_s * 1e3, "drop_all_sinks_ms": drop_s * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contributors", default="8,64,256")
    parser.add_argument("--chunks", default="256,1024")
    args = parser.parse_args(argv)
    print("| contributors W | open chunks K | contribute us each | open_chunks() ms | "
          "GetStatus rows ms | scrape count ms | "
          "drop_sink x W ms |")
    print("|---|---|---|---|---|---|---|")
    for chunks in (int(k) for k in args.chunks.split(",")):
        for contributors in (int(w) for w in args.contributors.split(",")):
            r = measure(contributors, chunks)
            print(f"| {contributors} | {chunks} | {r['contribute_us_each']:.2f} | "
                  f"{r['open_chunks_ms']:.1f} | {r['status_ms']:.2f} | {r['scrape_ms']:.2f} | "
                  f"{r['drop_all_sinks_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
