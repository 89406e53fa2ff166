"""The gRPC servicer of reducer.v1.Reducer: Reduce streams into the Session, and GetStatus.

Thin on purpose: each Reduce call is a Stream of the Session (MAX_REDUCE_CALLS
of them at once, half per job of a job token). A reader task
hands every received message to Session.accept; the handler writes out what
the Session puts into the stream's outbox (reducerd.dataplane.outbox: its bytes count
against --max-inflight-bytes until gRPC took them). Back-pressure: the reader
takes no next message while the stream has UNSENT_BYTES of replies waiting,
its job holds its share of the memory limit or the daemon is over it, so
gRPC's flow control slows a client that does not read; a reply that gRPC
cannot hand on for `send_timeout_s` ends the call with UNAVAILABLE. Shards
are decoded by reducer_wire.codec, not the generated classes, so shard data
is never copied on its way in (a view into the received message); replies come serialized.
All of it runs on the daemon's one event loop thread.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd import __version__
from reducerd.core.limits import StreamCount
from reducerd.core.names import short_name
from reducerd.dataplane.outbox import AsyncOutbox
from reducerd.service.access import EVERY_JOB, Access, Grant
from reducerd.service.session import END, Session, Stream, daemon_fault_message, decode_request

__all__ = ["ReducerServicer", "INBAND_METADATA"]

log = logging.getLogger("reducerd")

INBAND_METADATA = ("reducer-errors", "inband")
STALLED_LISTED_AT_MOST = 100
# Bytes of JobStatus rows one GetStatus reply carries at most, whatever
# max_jobs asks: with the stalled chunks (100 at most, a few KiB each with the
# longest names) it stays far below the clients' 4 MiB message limit. A row
# is about 100 bytes and its job id (up to 4 KB in UTF-8).
STATUS_JOB_BYTES = 2 << 20
UNSENT_BYTES = 16 << 20
# Reduce calls open at once, and half of them per job of a job token
# (limits.StreamCount); beyond, a new call is refused with RESOURCE_EXHAUSTED.
MAX_REDUCE_CALLS = 4096
# How often a reader paused by the memory limit (or its job's share) looks again.
_OVER_LIMIT_POLL_S = 0.01


class _Throughput:
    """Bytes per second over a sliding window, from cumulative counters."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()

    def rate(self, now: float, bytes_in: int, bytes_out: int) -> tuple[float, float]:
        self.samples.append((now, bytes_in, bytes_out))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, in0, out0 = self.samples[0]
        span = now - t0
        if span <= 0:
            return 0.0, 0.0
        return (bytes_in - in0) / span, (bytes_out - out0) / span


def _serialized(message: bytes) -> bytes:
    return message  # the Session hands gRPC streams each reply's bytes, made once


class ReducerServicer:
    """Reduce and GetStatus over one Session."""

    def __init__(self, session: Session, stalled_after_s: float,
                 send_timeout_s: float = 60.0, status_max_jobs: int = 100) -> None:
        self.session = session
        self.stalled_after_s = stalled_after_s
        # Jobs a GetStatus lists unless its request asks for another number.
        self.status_max_jobs = status_max_jobs
        self.send_timeout_s = send_timeout_s
        # The TCP data plane's port, set by the daemon when it serves one.
        self.data_port = 0
        # Which jobs a call's token reaches; set by the daemon (no token: all).
        self.access = Access(None)
        # Told the peer of every call that passed the token check (grpc_peers).
        self.on_authenticated: Callable[[str], None] = lambda peer: None
        self.started_s = time.monotonic()
        self._throughput: dict[str, _Throughput] = {}
        # Read when built, not when imported: tests start daemons with smaller caps.
        self.calls = StreamCount(MAX_REDUCE_CALLS, "Reduce calls")

    def handler(self) -> grpc.GenericRpcHandler:
        """The reducer.v1.Reducer service with our own Shard codec."""
        return grpc.method_handlers_generic_handler("reducer.v1.Reducer", {
            "Reduce": grpc.stream_stream_rpc_method_handler(
                self.Reduce, request_deserializer=decode_request,
                response_serializer=_serialized),
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                self.GetStatus, request_deserializer=pb.StatusRequest.FromString,
                response_serializer=pb.StatusReply.SerializeToString),
        })

    async def Reduce(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.session.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "reducerd is shutting down")
        metadata = tuple(context.invocation_metadata() or ())
        grant = self.access.grant_for_metadata(metadata)
        if grant is None:  # the interceptor refuses these first
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        assert grant is not None
        self.on_authenticated(context.peer())
        refusal = self.calls.refusal(grant.job)
        if refusal is not None:
            self.session.refusals.log(logging.INFO, ("stream", grant.job, "calls"),
                                      f"stream from {context.peer()} refused: {refusal}")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        self.calls.add(grant.job)
        try:
            await self._serve(request_iterator, context, grant, metadata)
        finally:
            self.calls.remove(grant.job)

    async def _serve(self, request_iterator, context: grpc.aio.ServicerContext,
                     grant: Grant, metadata: tuple) -> None:
        outbox = AsyncOutbox(self.session.table.budget, UNSENT_BYTES)
        stream = Stream(context.peer(), INBAND_METADATA in metadata, outbox=outbox,
                        job=grant.job)
        self.session.open_stream(stream)
        reader = asyncio.create_task(self._read(request_iterator, stream))
        try:
            while True:
                item = await outbox.get()
                if item is END:
                    return
                if isinstance(item, tuple):  # (code, message): end the stream
                    await context.abort(*item)
                try:
                    async with asyncio.timeout(self.send_timeout_s):
                        await context.write(item)
                except TimeoutError:
                    log.info("stream from %s: no reply taken for %g s; ending it", stream.peer,
                             self.send_timeout_s)
                    # Forget it now: the status below waits behind the unread replies
                    # (what gRPC already took stays gRPC's until the client reads or goes).
                    self._forget(reader, outbox, stream)
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"the client read no reply for {self.send_timeout_s:g} s")
                outbox.sent(item)
        finally:
            self._forget(reader, outbox, stream)

    def _forget(self, reader: asyncio.Task, outbox: AsyncOutbox, stream: Stream) -> None:
        """Stop reading the stream and forget it and its unsent replies (idempotent)."""
        reader.cancel()
        outbox.discard()
        self.session.close_stream(stream)

    async def _read(self, request_iterator, stream: Stream) -> None:
        messages = request_iterator.__aiter__()
        budget = self.session.table.budget
        while True:
            if isinstance(stream.outbox, AsyncOutbox):
                await stream.outbox.room()  # replies unread: read no more for now
            while ((budget.held_bytes > budget.limit_bytes
                    or not budget.job_has_room(stream.tenant)) and not stream.ended):
                await asyncio.sleep(_OVER_LIMIT_POLL_S)
            try:
                shard = await messages.__anext__()
            except StopAsyncIteration:
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if stream.ended:  # we ended the call (its abort wakes this read): no fault
                    return
                # Not a bad message (decode_request answers those, never raising):
                # gRPC itself failed to hand us the next one. Not the client's fault.
                log.exception("reducerd fault while reading the stream from %s", stream.peer)
                stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
                return
            if not self.session.accept(shard, stream):
                return
        stream.half_close()

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.StatusReply:
        grant = (self.access.grant_for_metadata(context.invocation_metadata())
                 if self.access.required else EVERY_JOB)
        refusal = _status_refusal(grant, request)
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED if grant else
                                grpc.StatusCode.UNAUTHENTICATED, refusal)
        self.on_authenticated(context.peer())
        try:
            return self._status(request)
        except Exception as exc:
            log.exception("reducerd fault while answering GetStatus")
            await context.abort(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
            raise  # not reached: abort raises

    def _status(self, request: pb.StatusRequest) -> pb.StatusReply:
        table = self.session.table
        now = time.monotonic()
        reply = pb.StatusReply(
            version=__version__, uptime_s=now - self.started_s,
            bytes_held=table.budget.held_bytes, max_inflight_bytes=table.max_inflight_bytes,
            open_streams=len(self.session.streams), stalled_after_s=self.stalled_after_s,
            round_timeout_s=table.round_timeout_s, data_port=self.data_port,
            record_bytes=table.records.held_bytes, max_record_bytes=table.records.limit_bytes)
        if request.brief:
            return reply
        jobs = ([(request.job, table.jobs[request.job])] if request.job in table.jobs
                else [] if request.job else table.jobs.items())
        reply.jobs_total = len(jobs)
        reply.jobs_open = sum(1 for _, stats in jobs if stats.open_chunks)
        # The most recently active first; a daemon with 16,000 jobs answers in a
        # few KiB unless asked for more (and then within STATUS_JOB_BYTES).
        listed = heapq.nlargest(request.max_jobs or self.status_max_jobs, jobs,
                                key=lambda item: (item[1].last_active_s, item[0]))
        row_bytes = 0
        for name, stats in sorted(listed, key=lambda item: item[0]):  # listed by name
            rate_in, rate_out = self._throughput.setdefault(name, _Throughput()).rate(
                now, stats.bytes_in, stats.bytes_out)
            row = reply.jobs.add(job=name, chunks_completed=stats.chunks_completed,
                                 chunks_failed=stats.chunks_failed,
                                 open_chunks=stats.open_chunks,
                                 open_chunk_bytes=stats.open_chunk_bytes,
                                 bytes_in=stats.bytes_in, bytes_out=stats.bytes_out,
                                 bytes_in_per_s=rate_in, bytes_out_per_s=rate_out,
                                 world_sizes=sorted(stats.world_sizes),
                                 first_seen_unix_s=stats.first_seen_s)
            row_bytes += row.ByteSize() + 4  # its tag and length
            if row_bytes > STATUS_JOB_BYTES:
                del reply.jobs[-1]
                break
        for name in [name for name in self._throughput if name not in table.jobs]:
            del self._throughput[name]  # a forgotten job's window goes with it
        for cid, world_size, missing, age_s in table.open_chunks(
                self.stalled_after_s, STALLED_LISTED_AT_MOST, request.job):
            reply.stalled.add(job=cid.job, key=cid.key, round=cid.round, offset=cid.offset,
                              world_size=world_size, missing_ranks=missing, age_s=age_s)
        return reply


def _status_refusal(grant: Grant | None, request: pb.StatusRequest) -> str:
    """Why this caller may not have this status, or ''. A job token reads the
    brief status and its own job's."""
    if grant is None:
        return "missing or wrong token"
    if grant.job is None or request.brief:
        return ""
    if request.job != grant.job:
        asked = f"job {short_name(request.job)}" if request.job else "every job"
        return (f"the token is job {short_name(grant.job)}'s: it reads that job's status "
                f"(StatusRequest job={short_name(grant.job)}, reducerd status --job) or the brief "
                f"status, not {asked}'s")
    return ""
