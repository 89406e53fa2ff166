"""Reply messages, serialized once: a result is narrowed straight into its message.

A completed chunk's reply is one buffer: the data plane's 5-byte frame header,
then the Shard message (header fields, then the data field, whose bytes the
float32 accumulator is narrowed into by reducer_wire.convert.to_wire(out=)).
The data plane sends the whole buffer; gRPC, whose API takes bytes only,
gets one bytes copy of the message part per delivery, shared by its streams.
Every stream of the chunk, and a resend answered from the result cache, gets
the same bytes. The message is byte-identical to the generated protobuf's
serialization (reducer_wire.codec.ShardEncoder lays it out; tests/unit/
test_session.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from reducer_wire import convert, dtypes
from reducer_wire.codec import ShardEncoder
from reducer_wire.framing import FRAME_HEADER_BYTES, SHARD, frame_header

__all__ = ["Reply", "result_reply", "empty_result_reply", "error_reply"]

# The payload starts on a cache line, so the narrowing's stores never split one.
_PAYLOAD_ALIGN = 64


@dataclass(frozen=True, slots=True)
class Reply:
    """One reply Shard for every stream it goes to.

    frame: the data-plane frame (header + message), what the data plane sends.
    payload: the data field's bytes (the result in the wire dtype; empty for errors).
    held_bytes: the memory this reply holds (for the result cache's bound).
    """

    frame: memoryview
    payload: memoryview
    held_bytes: int

    @property
    def message(self) -> memoryview:
        """The serialized Shard alone (what gRPC sends)."""
        return self.frame[FRAME_HEADER_BYTES:]


def result_reply(*, job: str, key: str, round: int, offset: int, dtype: int, op: int,
                 world_size: int, acc: np.ndarray) -> Reply:
    """The reply carrying `acc` (float32) rounded once to `dtype`, written in place."""
    reply = empty_result_reply(job=job, key=key, round=round, offset=offset, dtype=dtype,
                               op=op, world_size=world_size, numel=acc.size)
    convert.to_wire(acc, dtype, out=reply.payload)
    return reply


def empty_result_reply(*, job: str, key: str, round: int, offset: int, dtype: int, op: int,
                       world_size: int, numel: int) -> Reply:
    """A result's reply with its payload (`numel` elements of `dtype`) still to
    be written: by to_wire, or by a summing thread's narrowing in C."""
    nbytes = dtypes.wire_nbytes(dtype, numel)
    encoder = ShardEncoder(job=job, key=key, round=round, offset=offset, dtype=dtype, op=op,
                           world_size=world_size, data_nbytes=nbytes)
    lead = FRAME_HEADER_BYTES + encoder.nbytes - nbytes  # a result has no field after data
    block = np.empty(_PAYLOAD_ALIGN - 1 + FRAME_HEADER_BYTES + encoder.nbytes, dtype=np.uint8)
    start = -(block.__array_interface__["data"][0] + lead) % _PAYLOAD_ALIGN
    frame = block[start:start + FRAME_HEADER_BYTES + encoder.nbytes].data
    frame[:FRAME_HEADER_BYTES] = frame_header(SHARD, encoder.nbytes)
    payload = encoder.write_into(frame[FRAME_HEADER_BYTES:])
    return Reply(frame, payload, block.nbytes)


def error_reply(*, job: str, key: str, round: int, offset: int, dtype: int, op: int,
                world_size: int, error_code: int, error_message: str) -> Reply:
    """An in-band failure of one chunk (no data)."""
    encoder = ShardEncoder(job=job, key=key, round=round, offset=offset, dtype=dtype, op=op,
                           world_size=world_size, error_code=error_code,
                           error_message=error_message)
    frame = memoryview(bytearray(FRAME_HEADER_BYTES + encoder.nbytes))
    frame[:FRAME_HEADER_BYTES] = frame_header(SHARD, encoder.nbytes)
    payload = encoder.write_into(frame[FRAME_HEADER_BYTES:])
    return Reply(frame, payload, len(frame))
