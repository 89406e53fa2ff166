"""Shard messages to and from bytes without copying the data field.

The generated protobuf classes copy `data` when parsing, again when it is
read, and again when serializing; for megabyte shards those copies were a
large part of the daemon's and the client's CPU time. This module speaks the
same wire format (proto3, reducer.v1.Shard) by hand: decoding returns the data
field as a memoryview into the received buffer; ShardEncoder lays a message
out in a caller's buffer, the data field's payload a writable view the caller
fills (convert.to_wire(values, dtype, out=payload) narrows straight into it),
so a message is made without a copy of its data; encode_shard joins the data
once into new bytes. tests/unit/test_shardcodec.py checks both against the
generated code, byte for byte, on arbitrary messages.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ShardView", "ShardEncoder", "decode_shard", "encode_shard", "encode_shard_into",
           "DecodeError", "MAX_NAME_CHARS"]

# A Shard's job and key are at most this many characters (contract section 2):
# a daemon keeps them with every open chunk and failure, outside its memory budget.
MAX_NAME_CHARS = 1024

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


class DecodeError(ValueError):
    """The bytes are not a valid Shard message."""


class ShardView(NamedTuple):
    """A decoded Shard; `data` is a view into the message buffer (no copy)."""

    job: str = ""
    rank: int = 0
    world_size: int = 0
    round: int = 0
    key: str = ""
    offset: int = 0
    dtype: int = 0
    op: int = 0
    data: memoryview = memoryview(b"")
    error_code: int = 0
    error_message: str = ""
    layout: int = 0
    priority: int = 0
    incarnation: int = 0


# field number -> (name, kind); kind: "u32" / "u64" / "enum" varints, "str", "bytes".
try:
    from reducer_wire import _codec as _c_codec  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the Python parse alone
    _c_codec = None

_FIELDS = {1: ("job", "str"), 2: ("rank", "u32"), 3: ("world_size", "u32"),
           4: ("round", "u64"), 5: ("key", "str"), 6: ("offset", "u64"),
           7: ("dtype", "enum"), 8: ("op", "enum"), 9: ("data", "bytes"),
           10: ("error_code", "u32"), 11: ("error_message", "str"), 12: ("layout", "u64"),
           13: ("priority", "u32"), 14: ("incarnation", "u64")}


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise DecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def decode_shard(message: bytes | memoryview) -> ShardView:
    """Parse a serialized Shard; raise DecodeError when it is not one.

    On the daemon's path for every frame: the C parse (reducer_wire._codec)
    takes the plain case and hands anything unusual back to the Python one
    below, so both give the same results and errors. In Python, one-byte
    varints (every tag, most values and lengths) are read inline."""
    buf = memoryview(message).cast("B")
    if _c_codec is not None:
        fields = _c_codec.decode_fields(buf)
        if fields is not None:
            start = fields[8]
            data = buf[start:start + fields[9]] if start >= 0 else memoryview(b"")
            return ShardView(*fields[:8], data, *fields[10:])  # type: ignore[misc,call-arg]
    return _decode_in_python(buf)


def _decode_in_python(buf: memoryview) -> ShardView:
    values: dict[str, object] = {}
    pos, end = 0, len(buf)
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0 or number >= 1 << 29:
            raise DecodeError(f"field number {number} out of range")
        value: int | memoryview
        if wire_type == 0 or wire_type == 2:
            number_value: int
            if pos < end and buf[pos] < 0x80:
                number_value, pos = buf[pos], pos + 1
            else:
                number_value, pos = _varint(buf, pos, end)
            value = number_value
            if wire_type == 2:
                if pos + number_value > end:
                    raise DecodeError("truncated length-delimited field")
                value, pos = buf[pos:pos + number_value], pos + number_value
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            if pos > end:
                raise DecodeError("truncated fixed-width field")
            continue  # no Shard field has this type: unknown, skipped
        else:
            raise DecodeError(f"wire type {wire_type}")
        field = _FIELDS.get(number)
        if field is None:
            continue  # unknown field (a newer sender): skipped, as protobuf does
        name, kind = field
        if (kind in ("str", "bytes")) != (wire_type == 2):
            continue  # a known number with another wire type: unknown, as protobuf does
        if kind == "bytes":
            values[name] = value
        elif kind == "str":
            try:
                values[name] = bytes(value).decode("utf-8")  # type: ignore[arg-type]
            except UnicodeDecodeError:
                raise DecodeError(f"field {name} is not valid UTF-8") from None
        elif kind == "u32":
            values[name] = value & _U32  # type: ignore[operator]
        elif kind == "enum":  # int32 on the wire: sign-extend from 64 bits
            value = value & _U64  # type: ignore[operator]
            value &= _U32
            values[name] = value - (1 << 32) if value >= 1 << 31 else value
        else:
            values[name] = value & _U64  # type: ignore[operator]
    return ShardView(**values)  # type: ignore[arg-type]


def _put_varint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_fields(out: bytearray, fields: tuple[tuple[int, int | str], ...]) -> None:
    """Append non-default varint and string fields, as protobuf omits defaults."""
    for number, value in fields:
        if isinstance(value, str):
            if value:
                raw = value.encode("utf-8")
                _put_varint(out, number << 3 | 2)
                _put_varint(out, len(raw))
                out += raw
        elif value:
            _put_varint(out, number << 3)
            _put_varint(out, value & _U64)


class ShardEncoder:
    """One Shard laid out for a caller's buffer: the fields before `data`, the
    data field's payload (data_nbytes bytes), the fields after it.

        encoder = ShardEncoder(job="j", key="k", round=3, dtype=dtype, data_nbytes=n)
        buffer = bytearray(encoder.nbytes)             # or a recycled buffer
        payload = encoder.write_into(buffer)           # header and tail written
        convert.to_wire(values, dtype, out=payload)    # the data, in place

    The bytes are those of the generated code's SerializeToString (fields in
    number order, defaults omitted; no data field when data_nbytes is 0).
    """

    __slots__ = ("_head", "_tail", "data_nbytes", "nbytes")

    def __init__(self, *, job: str, key: str, rank: int = 0, world_size: int = 0,
                 round: int = 0, offset: int = 0, dtype: int = 0, op: int = 0,
                 data_nbytes: int = 0, error_code: int = 0, error_message: str = "",
                 layout: int = 0, priority: int = 0, incarnation: int = 0) -> None:
        if data_nbytes < 0:
            raise ValueError(f"data_nbytes must be >= 0, got {data_nbytes}")
        head = bytearray()
        _put_fields(head, ((1, job), (2, rank), (3, world_size), (4, round), (5, key),
                           (6, offset), (7, dtype), (8, op)))
        if data_nbytes:
            _put_varint(head, 9 << 3 | 2)
            _put_varint(head, data_nbytes)
        tail = bytearray()
        _put_fields(tail, ((10, error_code), (11, error_message), (12, layout),
                           (13, priority), (14, incarnation)))
        self._head, self._tail = bytes(head), bytes(tail)
        self.data_nbytes = data_nbytes
        self.nbytes = len(head) + data_nbytes + len(tail)

    def write_into(self, out: bytearray | memoryview | object) -> memoryview:
        """Write the header and tail into `out` (exactly nbytes, writable, any
        C-contiguous buffer); return the writable view of the data's payload."""
        view = memoryview(out).cast("B")  # type: ignore[arg-type]
        if len(view) != self.nbytes or view.readonly:
            raise ValueError(f"write_into: out must be a writable buffer of {self.nbytes} "
                             f"bytes, got {len(view)}{' read-only' if view.readonly else ''}")
        start = len(self._head)
        end = start + self.data_nbytes
        view[:start] = self._head
        view[end:] = self._tail
        return view[start:end]

    def join(self, data: bytes | memoryview) -> bytes:
        """The whole message as new bytes, `data` (data_nbytes bytes) copied once."""
        if memoryview(data).nbytes != self.data_nbytes:
            raise ValueError(f"data has {memoryview(data).nbytes} bytes, the encoder "
                             f"was made for {self.data_nbytes}")
        if not self.data_nbytes:
            return self._head + self._tail
        return b"".join((self._head, data, self._tail))


def encode_shard(*, job: str, key: str, rank: int = 0, world_size: int = 0, round: int = 0,
                 offset: int = 0, dtype: int = 0, op: int = 0,
                 data: bytes | memoryview = b"", error_code: int = 0,
                 error_message: str = "", layout: int = 0, priority: int = 0,
                 incarnation: int = 0) -> bytes:
    """Serialize a Shard exactly as the generated code does (fields in number order)."""
    return ShardEncoder(job=job, key=key, rank=rank, world_size=world_size, round=round,
                        offset=offset, dtype=dtype, op=op, data_nbytes=memoryview(data).nbytes,
                        error_code=error_code, error_message=error_message,
                        layout=layout, priority=priority,
                        incarnation=incarnation).join(data)


def encode_shard_into(out: bytearray | memoryview | object, *, job: str, key: str,
                      data: bytes | memoryview = b"", **fields: int | str) -> int:
    """Serialize a Shard into the start of `out` (writable, large enough); the
    number of bytes written. The data is copied once, into place."""
    encoder = ShardEncoder(job=job, key=key, data_nbytes=memoryview(data).nbytes,
                           **fields)  # type: ignore[arg-type]
    view = memoryview(out).cast("B")  # type: ignore[arg-type]
    if len(view) < encoder.nbytes:
        raise ValueError(f"encode_shard_into: the message needs {encoder.nbytes} bytes, "
                         f"out has {len(view)}")
    encoder.write_into(view[:encoder.nbytes])[:] = memoryview(data).cast("B")
    return encoder.nbytes
