"""The Python path of a key's chunks: each encoded, queued and answered
through its daemon's DaemonLink (transport/link.py), paced by a SendOrder
(transport/order.py). What the C loop (fastpath.py) does not carry
goes this way: gRPC, TLS, float64 arrays, keys sent while a C connection is
down, and everything where the loop was not built or is off.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from reducer_wire import convert, dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardEncoder
from reducer_wire.layout import Chunk

from reducer_client.ops import Operation
from reducer_client.transport.link import DaemonLink
from reducer_client.transport.order import CREDITS_PER_LINK, WINDOW_PER_DAEMON, SendOrder

__all__ = ["send_in_python"]


def send_in_python(links: Sequence[DaemonLink], operation: Operation,
                   values: np.ndarray | None, base: int, chunks: Sequence[Chunk], *, job: str,
                   rank: int, world_size: int, op: int, layouts: Sequence[int], priority: int,
                   incarnation: int) -> None:
    """Send values[c.offset - base:] of every chunk c as its own Shard, narrowed
    straight into a message buffer the link recycles, so the first chunks are
    on the wire while later ones are still converted; values=None sends -0.0
    (a broadcast's non-root ranks). Stops once the operation has failed."""
    key, round_, dtype = operation.key, operation.round, operation.dtype
    # The chunks leave in step across the links (transport/order.py).
    window = WINDOW_PER_DAEMON * len(links)
    order = (SendOrder(len(chunks), window, credits=CREDITS_PER_LINK)
             if len(chunks) > window else None)
    if order is not None:
        operation.future.add_done_callback(lambda _: order.release())
    for index, chunk in enumerate(chunks):
        if operation.settled:  # failed meanwhile: send no more of it
            break
        link = links[chunk.daemon]
        encoder = ShardEncoder(job=job, rank=rank, world_size=world_size, round=round_,
                               key=key, offset=chunk.offset, dtype=dtype, op=op,
                               layout=layouts[chunk.daemon],
                               data_nbytes=dtypes.wire_nbytes(dtype, chunk.numel),
                               priority=priority, incarnation=incarnation)
        message = link.message((key, chunk.offset), encoder.nbytes)
        payload = encoder.write_into(message.shard)
        if values is None:
            assert dtype == pb.DTYPE_FLOAT32, "only broadcast sends zeros"
            np.frombuffer(payload, dtype="<f4").fill(-0.0)
        else:
            begin = chunk.offset - base
            convert.to_wire(values[begin:begin + chunk.numel], dtype, out=payload)
        turn = order.turn(index, chunk.daemon) if order else None
        link.send((key, round_, chunk.offset), message, operation.handler(index),
                  operation.deadline_s, turn, priority)
