"""The answers a daemon that sums on summing threads may give one fuzzed stream.

With `--threads N > 1 --pool-chunk-bytes 0` every chunk is summed on a
summing thread: the loop counts a contribution at once, but a chunk's result
lands back on the loop later, between any two messages the loop takes.
Contract section 2 leaves that time open (replies may come in any order), so
one stream has a set of allowed answers, one per interleaving of landings
with the messages read. PooledModel plays the daemon's rules for one stream
(reducerd.core.reduction, chunk_sums, session) with the landing as an explicit
step, and `pooled_outcomes` walks every interleaving:

- a chunk complete but not landed is open: a contribution resent to it is
  answered only when it lands, after the result (the result once more, or
  INVALID_ARGUMENT if it disagrees), so the stream reads on meanwhile;
- an end (a bad message, an out-of-band failure) waits while a chunk the
  stream completed is still being summed, and the results and answers that
  land meanwhile go out before the status; the first end decided is the
  status, and an out-of-band failure landing after it ends nothing more;
- nothing goes out after the status, every result is the float32 sum of
  the contributions counted (fuzz_model's numerics), and a chunk still
  incomplete after the half-close fails with DEADLINE_EXCEEDED once every
  landing is in.

What it leaves out (the fuzz never reaches it): a landing after the round
timeout, a restart of the job's incarnation, the limits on open chunks and
memory. Each fuzzed stream has jobs of its own, so its chunks have one sink.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import grpc
import numpy as np
from fuzz_model import (
    BF16,
    F16,
    F32,
    INVALID,
    Event,
    Expected,
    cache_result,
    chunk_result,
    error_reply,
    invalid_on_its_own,
    numel_of,
    result_reply,
    widen,
)
from reducer_wire import dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

__all__ = ["DELAYED_SUMS", "Outcome", "PooledModel", "pooled_outcomes", "MAX_STATES"]

DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
# Interleavings walked per stream at most (distinct states; a fuzzed stream
# has at most 9 messages, and states that differ only in the order of other
# chunks' replies are one): a bound on the test's time, asserted.
MAX_STATES = 50_000


@dataclass
class _Chunk:
    first: pb.Shard
    numel: int
    acc: np.ndarray | None
    ranks: set[int] = field(default_factory=set)
    summing: bool = False  # complete, its result not landed yet
    resends: list[tuple[pb.Shard, bool]] = field(default_factory=list)  # (shard, disagrees)


@dataclass
class Outcome:
    """One allowed answer: what mismatches() reads of a model."""

    code: grpc.StatusCode | None
    early: bool
    replies: list[Expected]


class PooledModel:
    """One stream on a pooled daemon; land(cid) is a summing thread's result arriving."""

    def __init__(self, inband: bool) -> None:
        self.inband = inband
        self.replies: list[Expected] = []
        self.code: grpc.StatusCode | None = None  # the status put out, once it is
        self.early = False
        self.ended = False  # an end decided (its status may be held)
        self.held: grpc.StatusCode | None = None
        self.half_closed = False
        self.open: dict[tuple, _Chunk] = {}  # in the order they opened, as the daemon expires
        self.results: dict[tuple, tuple[pb.Shard, int, bytes | None]] = {}
        self.latest: dict[tuple, int] = {}  # (job, key, offset) -> round of its cached result
        self.failed: dict[tuple, grpc.StatusCode] = {}
        self.waiting: set[tuple] = set()

    # -- the stream's events -------------------------------------------------

    def accept(self, shard: pb.Shard | None) -> bool:
        """Take one message; False once the stream has ended (no more are read)."""
        if self.ended:
            return False
        if shard is None or invalid_on_its_own(shard):
            self.end(INVALID)
            return False
        cid = (shard.job, shard.key, shard.round, shard.offset)
        self.waiting.add(cid)
        self._batch(self._contribute(cid, shard))
        return not self.ended

    def end(self, code: grpc.StatusCode) -> None:
        """Stream.end: the first end counts; held while a result is still summed."""
        if self.ended:
            return
        self.ended, self.early = True, not self.half_closed
        if any(self.open[c].summing for c in self.waiting if c in self.open):
            self.held = code
        else:
            self.code = code

    def half_close(self) -> None:
        self.half_closed = True
        self._maybe_finish()

    def summing(self) -> list[tuple]:
        return [cid for cid, chunk in self.open.items() if chunk.summing]

    def land(self, cid: tuple) -> None:
        """The chunk's result arrives: the result, then each resend's answer."""
        chunk = self.open.pop(cid)
        f, data = chunk.first, chunk_result(chunk.first, chunk.acc)
        cache_result(self.results, self.latest, cid, (f, chunk.numel, data))
        batch = [self._result(cid, f, chunk.numel, data)]
        for shard, disagrees in chunk.resends:
            batch.append(self._error(cid, shard, INVALID) if disagrees
                         else self._result(cid, f, chunk.numel, data))
        self._batch(batch)

    def expire(self) -> None:
        """The round timeout after everything landed: what is open fails, oldest first."""
        batch = []
        for cid, chunk in list(self.open.items()):
            del self.open[cid]
            self.failed[cid] = DEADLINE
            batch.append(self._error(cid, chunk.first, DEADLINE))
        self._batch(batch)

    # -- the table (reducerd.core.reduction with chunk_sums) ----------------------

    def _contribute(self, cid: tuple, s: pb.Shard) -> list:
        numel = numel_of(s)
        if cid in self.failed:
            return [self._error(cid, s, self.failed[cid])]
        if cid in self.results:
            first, result_numel, data = self.results[cid]
            if (s.dtype, numel, s.world_size) != (first.dtype, result_numel, first.world_size):
                return [self._error(cid, s, INVALID)]
            return [self._result(cid, first, result_numel, data)]
        chunk = self.open.get(cid)
        if chunk is None:
            known = s.dtype in (F16, BF16, F32)
            self.open[cid] = _Chunk(s, numel, widen(s.data, s.dtype) if known else None, {s.rank},
                                    summing=s.world_size == 1)
            return []
        f = chunk.first
        if chunk.summing:  # PooledSums.resent: answered when the result lands
            chunk.resends.append((s, (s.dtype, numel, s.world_size) != (
                f.dtype, chunk.numel, f.world_size)))
            return []
        if (f.dtype, dtypes.OP_NAMES[f.op], f.world_size, chunk.numel) != (
                s.dtype, dtypes.OP_NAMES[s.op], s.world_size, numel):
            del self.open[cid]
            self.failed[cid] = INVALID
            return [self._error(cid, f, INVALID)]
        if s.rank not in chunk.ranks:
            chunk.ranks.add(s.rank)
            if chunk.acc is not None:
                with np.errstate(all="ignore"):
                    chunk.acc = chunk.acc + widen(s.data, s.dtype)
            chunk.summing = len(chunk.ranks) == f.world_size
        return []

    @staticmethod
    def _result(cid: tuple, first: pb.Shard, numel: int, data: bytes | None) -> tuple:
        return cid, None, result_reply(cid, first, numel, data)

    @staticmethod
    def _error(cid: tuple, ref: pb.Shard, code: grpc.StatusCode) -> tuple:
        return cid, code, error_reply(cid, ref, code)

    # -- the session (reducerd.service.session: deliver, then end what waits for nothing) --

    def _batch(self, batch: list[tuple]) -> None:
        if not batch:
            return
        for cid, code, reply in batch:
            self.waiting.discard(cid)
            if self.ended and self.held is None:
                continue  # the status is out: nothing after it
            if code is not None and not self.inband:
                self.end(code)
                continue
            self.replies.append(reply)
        self._maybe_finish()
        if self.held is not None and not any(
                self.open[c].summing for c in self.waiting if c in self.open):
            self.code, self.held = self.held, None

    def _maybe_finish(self) -> None:
        if self.half_closed and not self.waiting and not self.ended:
            self.ended, self.code = True, grpc.StatusCode.OK

    def signature(self) -> tuple:
        """The state, with other chunks' replies in any order (mismatches pairs them by chunk)."""
        replies = sorted((r.shard.job, r.shard.key, r.shard.round, r.shard.offset, i,
                          r.shard.SerializeToString(), r.data) for i, r in enumerate(self.replies))
        per_chunk = tuple(row[:4] + row[5:] for row in replies)
        chunks = tuple((cid, c.summing, tuple(sorted(c.ranks)), len(c.resends),
                        tuple(d for _, d in c.resends),
                        None if c.acc is None else c.acc.tobytes())
                       for cid, c in self.open.items())
        return (self.code, self.early, self.ended, self.held, self.half_closed, per_chunk,
                chunks, tuple(sorted(self.results)), tuple(sorted(self.latest.items())),
                tuple(sorted(self.failed.items())),
                tuple(sorted(self.waiting)))


def pooled_outcomes(events: list[Event], inband: bool) -> list[Outcome]:
    """Every answer the pooled daemon may give the stream, one per distinct interleaving."""
    outcomes: dict[tuple, Outcome] = {}
    seen: set[tuple] = set()

    def walk(model: PooledModel, at: int) -> None:
        key = (at, model.signature())
        if key in seen:
            return
        seen.add(key)
        assert len(seen) <= MAX_STATES, "too many interleavings to walk"
        for cid in model.summing():  # a result lands before the next event
            landed = copy.deepcopy(model)
            landed.land(cid)
            walk(landed, at)
        if at < len(events) and not model.ended:
            step = copy.deepcopy(model)
            event = events[at]
            if event[0] == "shard":
                step.accept(event[1])
            elif event[0] == "end":
                step.end(event[1])
            else:
                step.half_close()
            walk(step, at + 1)
        elif not model.summing():  # read all it reads, everything landed: the timeout
            done = copy.deepcopy(model)
            done.expire()
            outcomes.setdefault(done.signature(), Outcome(done.code, done.early, done.replies))

    walk(PooledModel(inband), 0)
    return list(outcomes.values())


# `python -c DELAYED_SUMS reducerd-args...`: a daemon whose summing threads
# wait 0-2 ms before each copy, add and finish, as a loaded core would: the
# fuzz's chunks are tiny and would otherwise land before the loop takes the
# stream's next message, so the race fuzz_pooled models would hardly be run.
DELAYED_SUMS = """
import random, sys, threading, time
from reducerd.core import chunk_sums
from reducerd.__main__ import main


def delayed(fn):
    def on_summing_thread_later(*args):
        if threading.current_thread().name.startswith("reducerd-sum"):
            time.sleep(random.random() * 0.002)
        return fn(*args)
    return on_summing_thread_later


acc = chunk_sums.accumulate
acc.copy_wire_into = delayed(acc.copy_wire_into)
acc.add_wire_into = delayed(acc.add_wire_into)
chunk_sums.narrow_result = delayed(chunk_sums.narrow_result)
sys.exit(main(sys.argv[1:]))
"""
