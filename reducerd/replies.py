"""Reply messages, serialized once: a result is narrowed straight into its message.

A completed chunk's reply is one buffer: the data plane's 5-byte frame header,
then the Shard message (header fields, then the data field, whose bytes the
float32 accumulator is narrowed into by reducer_wire.convert.to_wire(out=)).
The data plane sends the whole buffer, gRPC the message part; every stream
of the chunk, and a resend answered from the result cache, gets the same
bytes. The message is byte-identical to the generated protobuf's
serialization (tests/unit/test_session.py checks it).

reducer_wire.codec has no encoding into a caller's buffer yet, so the header
fields are written here with its _put_fields and _put_varint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from reducer_wire import convert, dtypes
from reducer_wire.codec import _put_fields, _put_varint, encode_shard
from reducer_wire.framing import FRAME_HEADER_BYTES, SHARD, frame_header

__all__ = ["Reply", "result_reply", "error_reply"]

_DATA_TAG = 9 << 3 | 2  # field 9 (data), length-delimited
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
    nbytes = acc.size * dtypes.wire_itemsize(dtype)
    head = bytearray()
    _put_fields(head, ((1, job), (3, world_size), (4, round), (5, key), (6, offset),
                       (7, dtype), (8, op)))
    _put_varint(head, _DATA_TAG)
    _put_varint(head, nbytes)
    lead = FRAME_HEADER_BYTES + len(head)
    block = np.empty(_PAYLOAD_ALIGN - 1 + lead + nbytes, dtype=np.uint8)
    start = -(block.ctypes.data + lead) % _PAYLOAD_ALIGN
    frame = block[start:start + lead + nbytes]
    frame[:FRAME_HEADER_BYTES] = np.frombuffer(frame_header(SHARD, len(head) + nbytes),
                                               np.uint8)
    frame[FRAME_HEADER_BYTES:lead] = np.frombuffer(head, np.uint8)
    payload = frame[lead:]
    convert.to_wire(acc, dtype, out=payload)
    return Reply(frame.data, payload.data, block.nbytes)


def error_reply(*, job: str, key: str, round: int, offset: int, dtype: int, op: int,
                world_size: int, error_code: int, error_message: str) -> Reply:
    """An in-band failure of one chunk (no data)."""
    message = encode_shard(job=job, key=key, round=round, offset=offset, dtype=dtype, op=op,
                           world_size=world_size, error_code=error_code,
                           error_message=error_message)
    frame = memoryview(frame_header(SHARD, len(message)) + message)
    return Reply(frame, frame[len(frame):], len(frame))
