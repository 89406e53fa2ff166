"""Stream bookkeeping: each stream's shards in, and the replies out to every stream.

A Stream is one Reduce call (grpc_service) or one data-plane connection
(dataplane): the transports only move bytes. The Session takes each message
a stream received (accept), checks it on its own (check_shard), counts it in
the ReductionTable, and puts what the table says to deliver into the outboxes
of the streams that wait for it (deliver). All of it runs on the daemon's
event loop thread, as the table requires.

An exception raised by the daemon's own code (the table, the accumulation,
the metrics) is the daemon's fault, not the client's: it is logged at ERROR
with its traceback, and the streams concerned end with INTERNAL and a message
that says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import grpc
from reducer_wire import dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import MAX_NAME_CHARS, DecodeError, ShardView, decode_shard

from reducerd.core.reduction import ChunkId, Contribution, Delivery, ReductionTable
from reducerd.core.replies import Reply, error_reply
from reducerd.ops.config import DEFAULT_MAX_WORLD_SIZE
from reducerd.ops.logs import RepeatLimiter, short_name
from reducerd.service.access import Grant

__all__ = ["END", "MAX_OFFSET", "DecodeFault", "Observer", "Session", "Stream", "check_shard",
           "decode_request", "daemon_fault_message"]

log = logging.getLogger("reducerd")

MAX_OFFSET = 1 << 63
# The wire dtypes both sides route (reducer_wire.dtypes: WIRE_DTYPES and the integer wires).
_ROUTED_DTYPES = frozenset(dtypes.WIRE_DTYPES.values()) | dtypes.INTEGER_WIRES
END = object()  # in an outbox: end the stream with OK


class Observer(Protocol):
    """Sees every valid shard and every delivery (reducerd.ops.metrics.Metrics); loop thread."""

    def shard_in(self, job: str, dtype: int, nbytes: int) -> None: ...

    def delivered(self, d: Delivery) -> None: ...


class Stream:
    """One Reduce call or data-plane connection: its outbox and the chunks it waits for.

    The outbox takes replies, then one last item: END (end with OK) or a
    (grpc.StatusCode, message) tuple (end with that status); the loop thread
    puts them (the data plane's reader also puts its own "connection broke"
    marker). A stream with `frames` (the data plane) takes each reply as a
    Reply, whose data-plane frame its writer sends; any other (gRPC, whose
    API takes bytes only) takes the bytes of the message.
    """

    def __init__(self, peer: str, inband_errors: bool, outbox: Any = None,
                 frames: bool = False, job: str | None = None) -> None:
        self.peer = peer
        # The one job its token allows (a job token), or None for every job.
        self.job = job
        # The job whose share of the memory budget its transport bytes count
        # against (reducerd.core.limits): its token's, else its first shard's.
        self.tenant: str | None = None
        # Its first shard was taken: a stream of a job already at its share is
        # refused (RESOURCE_EXHAUSTED, which clients retry) before it adds to it.
        self.admitted = False
        self.inband_errors = inband_errors
        self.frames = frames
        self.outbox = asyncio.Queue() if outbox is None else outbox
        if job is not None:
            self.count_against(job)
        self.waiting: set[ChunkId] = set()
        # Of the chunks it waits for, those whose shard gave a priority (Shard.priority).
        self.priorities: dict[ChunkId, int] = {}
        self.half_closed = False
        # Set once the last item is in the outbox: nothing more goes in, no shard is taken.
        self.ended = False
        self.last_message_s = time.monotonic()
        # With summing threads (set by the Session): whether chunks it waits for are
        # complete, their results still being summed. An end waits for those (held_end).
        self.results_pending: Callable[[], bool] | None = None
        self.held_end: tuple[grpc.StatusCode, str] | None = None

    def count_against(self, job: str) -> None:
        """Count this stream's transport bytes against `job`'s share, once (its
        token's job from the handshake, else the job of its first shard)."""
        if self.tenant is None:
            self.tenant = job
            if hasattr(self.outbox, "job"):  # a plain queue (tests) counts nothing
                self.outbox.job = job

    def half_close(self) -> None:
        """The client sent its last shard: end with OK once all it waits for is answered."""
        self.half_closed = True
        self.maybe_finish()

    def maybe_finish(self) -> None:
        if self.half_closed and not self.waiting:
            self.finish()

    def finish(self) -> None:
        """End with OK (after the replies already in the outbox)."""
        if not self.ended:
            self.ended = True
            self.outbox.put_nowait(END)

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """End with `code` (after the replies already in the outbox, and the results
        of chunks it completed that summing threads still sum); the first end counts."""
        if not self.ended:
            self.ended = True
            if self.results_pending is not None and self.results_pending():
                self.held_end = (code, message)  # put by end_when_delivered
            else:
                self.outbox.put_nowait((code, message))

    def end_when_delivered(self) -> None:
        """Put the held end once no result it waits for is still being summed."""
        if self.held_end is not None and not (self.results_pending and self.results_pending()):
            self.outbox.put_nowait(self.held_end)
            self.held_end = None


def _put(outbox: Any, item: Any, priority: int) -> None:
    """Into a stream's outbox, before the items of a lower priority (reducerd.dataplane.outbox)."""
    if priority:
        outbox.put_nowait(item, priority)
    else:
        outbox.put_nowait(item)


class DecodeFault(NamedTuple):
    """The decoder itself failed on a message (a bug of ours, not a bad message)."""

    exc: Exception


def decode_request(message: bytes | memoryview) -> ShardView | DecodeError | DecodeFault:
    """Decode a received message. Nothing is raised (gRPC would end the call
    with a bare INTERNAL): a bad message gives its DecodeError, a failure of
    the decoder itself a DecodeFault, and accept() answers each."""
    try:
        return decode_shard(message)
    except DecodeError as exc:
        return exc
    except Exception as exc:
        log.exception("reducerd fault while decoding a Shard message")
        return DecodeFault(exc)


def check_shard(shard: ShardView, max_world_size: int = DEFAULT_MAX_WORLD_SIZE) -> str:
    """Why this shard is invalid on its own (contract section 2), or '' if it is fine."""
    if not shard.job:
        return "job is empty"
    if not shard.key:
        return "key is empty"
    for name, value in (("job", shard.job), ("key", shard.key)):
        if len(value) > MAX_NAME_CHARS:
            return f"{name} has {len(value)} characters, above the limit of {MAX_NAME_CHARS}"
    if shard.dtype not in _ROUTED_DTYPES:
        return f"dtype {shard.dtype} is unspecified or unknown"
    if shard.op not in dtypes.OP_NAMES:
        return f"op {shard.op} is unknown"
    if shard.dtype in dtypes.INTEGER_WIRES and shard.op == pb.REDUCE_OP_MEAN:
        return (f"op mean on {dtypes.DTYPE_NAMES[shard.dtype]}: integer dtypes are summed "
                "only (the client divides, as Horovod does for integers)")
    if shard.world_size == 0:
        return "world_size is 0"
    if shard.world_size > max_world_size:
        return (f"world_size {shard.world_size} is above the daemon's limit of "
                f"{max_world_size} (--max-world-size)")
    if shard.rank >= shard.world_size:
        return f"rank {shard.rank} is not below world_size {shard.world_size}"
    if not shard.data:
        return "data is empty"
    numel = dtypes.wire_numel(shard.dtype, len(shard.data))
    if numel is None:
        return (f"data has {len(shard.data)} bytes, not a whole number of "
                f"{dtypes.DTYPE_NAMES[shard.dtype]} elements")
    if shard.offset + numel > MAX_OFFSET:
        return "offset + elements passes 2^63"
    return ""


def daemon_fault_message(exc: BaseException) -> str:
    return (f"reducerd internal error (a fault of the daemon, not of this client): "
            f"{exc!r}; the daemon's log has the traceback")


class Session:
    """The streams of both transports over one ReductionTable (loop thread)."""

    def __init__(self, table: ReductionTable, observer: Observer | None = None,
                 max_world_size: int = DEFAULT_MAX_WORLD_SIZE) -> None:
        self.table = table
        table.on_deliveries = self.deliver  # results summed off the loop land here
        self.observer = observer
        self.max_world_size = max_world_size
        self.streams: set[Stream] = set()
        self.draining = False  # set by the daemon: transports refuse new streams
        # Refusals and failures, one line per job and reason and period with the
        # repeats counted (a 64 MiB key has dozens of chunks; a hostile client
        # sends as many as it likes): the transports log theirs here too.
        self.refusals = RepeatLimiter(log)

    def open_stream(self, stream: Stream) -> None:
        self.streams.add(stream)
        if self.table.sums_off_loop:
            stream.results_pending = lambda: self.table.completing(stream.waiting)

    def close_stream(self, stream: Stream) -> None:
        """Forget a stream that ended; its counted contributions stay counted."""
        self.streams.discard(stream)
        try:
            self.table.drop_sink(stream, stream.waiting)  # not every open chunk
        except Exception:
            log.exception("reducerd fault while forgetting the stream from %s", stream.peer)

    def accept(self, shard: ShardView | DecodeError | DecodeFault, stream: Stream) -> bool:
        """Take one received message of `stream`; False when the stream ended
        (a message that is no valid Shard, or an ended stream: read no more)."""
        if stream.ended:
            return False
        if isinstance(shard, DecodeFault):
            stream.waiting.clear()
            stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(shard.exc))
            return False
        if isinstance(shard, DecodeError):
            stream.end(grpc.StatusCode.INVALID_ARGUMENT, f"malformed Shard message: {shard}")
            return False
        problem = check_shard(shard, self.max_world_size)
        if problem:
            stream.end(grpc.StatusCode.INVALID_ARGUMENT,
                       f"invalid shard (job {short_name(shard.job)} key "
                       f"{short_name(shard.key)} round "
                       f"{shard.round} rank {shard.rank}): {problem}")
            return False
        if stream.job is not None and shard.job != stream.job:
            # Before anything of it is counted: another job's sums stay its own.
            stream.end(grpc.StatusCode.PERMISSION_DENIED,
                       f"shard of job {short_name(shard.job)} key {short_name(shard.key)} "
                       "refused: "
                       f"{Grant(stream.job).refusal(shard.job)}")
            return False
        if not stream.admitted:  # its first shard: the stream joins its job's share
            refusal = self.table.budget.job_share_refusal(stream.tenant or shard.job,
                                                          len(shard.data))
            if refusal:
                stream.end(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
                return False
            stream.count_against(shard.job)
            stream.admitted = True
        try:
            self._contribute(shard, stream)
        except Exception as exc:
            self._daemon_fault(exc, f"taking a shard of job {short_name(shard.job)} key "
                                    f"{short_name(shard.key)} "
                                    f"round {shard.round} rank {shard.rank} from {stream.peer}",
                               (stream,))
            return False
        return not stream.ended

    def _contribute(self, shard: ShardView, stream: Stream) -> None:
        if shard.job not in self.table.jobs:
            log.info("job %s first seen (world size %d)", short_name(shard.job),
                     shard.world_size)
        if self.observer is not None:
            self.observer.shard_in(shard.job, shard.dtype, len(shard.data))
        cid = ChunkId(shard.job, shard.key, shard.round, shard.offset)
        part = Contribution(shard.rank, shard.world_size, shard.dtype, shard.op,
                            shard.data, shard.layout, shard.incarnation)
        stream.waiting.add(cid)
        if shard.priority:
            stream.priorities[cid] = shard.priority
        stream.last_message_s = time.monotonic()
        self.deliver(self.table.contribute(cid, part, stream))

    def deliver(self, deliveries: Iterable[Delivery]) -> None:
        """Put each delivery's reply (or failure) into its streams' outboxes;
        then end those that wait for nothing more (after the whole batch: a
        resend answered in the same batch goes out before the end)."""
        streams: dict[Stream, None] = {}
        for d in deliveries:
            streams.update(dict.fromkeys(d.sinks))  # type: ignore[arg-type]
            try:
                self._deliver(d)
            except Exception as exc:
                self._daemon_fault(exc, f"delivering {d.chunk.describe()}",
                                   d.sinks)  # type: ignore[arg-type]
        for stream in streams:
            stream.maybe_finish()
            stream.end_when_delivered()

    def _deliver(self, d: Delivery) -> None:
        if self.observer is not None:
            self.observer.delivered(d)
        code = grpc.StatusCode[d.error_code] if d.error_code else None
        if code is not None and not d.repeat:
            self._log_failure(d)
        reply: Reply | None = d.reply
        message: bytes | None = None  # the bytes gRPC sends, made once for all its streams
        # Once per stream: a retry on the stream that already waits adds nothing to hear.
        for sink in dict.fromkeys(d.sinks):
            stream: Stream = sink  # type: ignore[assignment]
            stream.waiting.discard(d.chunk)
            priority = stream.priorities.pop(d.chunk, 0) if stream.priorities else 0
            if stream.ended and stream.held_end is None:
                continue
            if code is not None and not stream.inband_errors:
                stream.end(code, d.error_message)
                continue
            if reply is None:
                assert code is not None
                reply = error_reply(job=d.chunk.job, key=d.chunk.key, round=d.chunk.round,
                                    offset=d.chunk.offset, dtype=d.dtype, op=d.op,
                                    world_size=d.world_size, error_code=code.value[0],
                                    error_message=d.error_message)
            if stream.frames:
                _put(stream.outbox, reply, priority)
            else:
                if message is None:
                    message = bytes(reply.message)
                _put(stream.outbox, message, priority)

    def expire(self, idle_timeout_s: float) -> None:
        """Fail chunks past the round timeout; end streams idle for `idle_timeout_s`."""
        try:
            deliveries = self.table.expire()
        except Exception:  # no stream to tell; the next tick tries again
            log.exception("reducerd fault while expiring chunks")
            return
        self.deliver(deliveries)
        self.end_idle_streams(idle_timeout_s)
        self.refusals.flush()

    def fail_all(self, code: str, reason: str) -> None:
        """Fail every open chunk (the daemon shuts down)."""
        try:
            deliveries = self.table.fail_all(code, reason)
        except Exception:
            log.exception("reducerd fault while failing the open chunks")
            return
        self.deliver(deliveries)

    def end_idle_streams(self, idle_timeout_s: float) -> None:
        """End (OK) streams that wait for nothing and sent nothing for a while,
        so a client that opens streams and goes quiet holds nothing for ever."""
        now = time.monotonic()
        for stream in list(self.streams):
            if not stream.waiting and now - stream.last_message_s >= idle_timeout_s:
                stream.finish()

    def _log_failure(self, d: Delivery) -> None:
        self.refusals.log(logging.WARNING, (d.chunk.job, d.error_code),
                          f"chunk failed ({d.error_code}): {d.error_message}")

    def _daemon_fault(self, exc: Exception, what: str, streams: Iterable[Stream]) -> None:
        """Log our own bug with its traceback; end `streams` with INTERNAL saying so."""
        log.exception("reducerd fault while %s", what)
        message = daemon_fault_message(exc)
        for stream in streams:
            stream.waiting.clear()
            stream.end(grpc.StatusCode.INTERNAL, message)
