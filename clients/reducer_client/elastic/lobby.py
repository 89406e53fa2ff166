"""Adding workers to a running elastic job: a joiner knocks, rank 0 lets it in at a commit.

Horovod's driver runs a discovery script and tells the workers of new
hosts; the workers see it at their next commit (HostsUpdatedInterrupt),
reset, and the new worker takes rank 0's state by sync(). There is no
driver here: the daemons are the one place every worker knows, so they are
the lobby.

- A joiner (a worker started with REDUCER_ELASTIC_JOIN=1, any rank and
  world size in its init) knocks: it opens a two-rank round of its own key
  elastic/knock/<random> as rank 1 of 2, with Shard.incarnation 0 (a knock
  is no client instance of the job: the daemons' restart rules never count
  it, so it disturbs no round of the job), and waits. The daemons list the
  open round among their stalled ones once it is --stalled-after old.
- At each commit, rank 0 (at most every POLL_INTERVAL_S) reads the daemons'
  stalled rounds of its job (GetStatus) and answers the knock with the most
  time left before its round timeout: its rank 0 contribution completes
  the knock's round, whose sum tells the joiner its rank (the old world
  size) and the new world size. Then every rank sums rank 0's count of
  admitted joiners (0 or 1) in a round of the current incarnation, so all
  of them see the same answer at the same commit.
- When it is 1, every rank raises HostsUpdatedInterrupt from commit();
  elastic.run resets all of them to the larger world (a new incarnation,
  fresh keys: no earlier sum reaches anyone) and sync() gives the joiner
  rank 0's state, which is the commit just made.

A knock left unanswered fails at the daemons' round timeout and the joiner
knocks again, until REDUCER_ELASTIC_JOIN_TIMEOUT (default JOIN_TIMEOUT_S)
has passed: then it stops with an error; the running job never waits for
it. One joiner is admitted per commit. The daemons' --stalled-after must be
below their --round-timeout (by ANSWER_MARGIN_S at least), and the clients'
timeout above the round timeout, as for elastic.run in general.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np

from reducer_client.api import Reducer
from reducer_client.compression import allreduce_async_on_wire
from reducer_client.errors import ReducerError
from reducer_client.transport.base import TransportError

__all__ = ["HostsUpdatedInterrupt", "HostWatch", "knock", "join_requested", "join_timeout_s",
           "JOIN_ENV", "JOIN_TIMEOUT_ENV", "JOIN_TIMEOUT_S", "POLL_INTERVAL_S",
           "KNOCK_PREFIX"]

JOIN_ENV = "REDUCER_ELASTIC_JOIN"
JOIN_TIMEOUT_ENV = "REDUCER_ELASTIC_JOIN_TIMEOUT"
JOIN_TIMEOUT_S = 300.0
POLL_INTERVAL_S = 1.0  # rank 0 reads the daemons' status at most this often (Horovod: 1 s)
ANSWER_MARGIN_S = 1.0  # a knock this close to its round timeout is left for the next one
ANSWER_TIMEOUT_S = 5.0  # rank 0's answer completes a knock at once; more means it expired
KNOCK_PREFIX = "elastic/knock/"
_log = logging.getLogger("reducer_client.elastic")


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by commit() on every rank when a worker was admitted (Horovod's name).

    elastic.run catches it: every rank resets to the larger world and the
    new worker is synced; the state is the commit just made, so nothing is
    restored. skip_sync is Horovod's field (False: the new worker needs it).
    """

    def __init__(self, added: int) -> None:
        super().__init__(f"{added} worker(s) joined")
        self.added, self.skip_sync = added, False


def join_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker added to a running job (REDUCER_ELASTIC_JOIN)."""
    value = (os.environ if environ is None else environ).get(JOIN_ENV, "")
    if value.strip().lower() in ("", "0", "false", "no"):
        return False
    if value.strip().lower() in ("1", "true", "yes"):
        return True
    raise ValueError(f"{JOIN_ENV}={value!r}: use 1 (join a running job) or 0")


def join_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """How long a joiner knocks before it gives up (REDUCER_ELASTIC_JOIN_TIMEOUT, seconds)."""
    value = (os.environ if environ is None else environ).get(JOIN_TIMEOUT_ENV, "")
    try:
        timeout_s = float(value) if value.strip() else JOIN_TIMEOUT_S
    except ValueError:
        timeout_s = -1.0
    if not timeout_s > 0:
        raise ValueError(f"{JOIN_TIMEOUT_ENV}={value!r}: give a number of seconds > 0")
    return timeout_s


def _lobby_client(build: Any, rank: int) -> Any:
    """A client of the job at world size 2 whose shards carry incarnation 0 (a knock)."""
    client = build(rank, 2)
    client.incarnation = 0  # read at each send; node-local aggregation is off here
    return client


def knock(build: Any, timeout_s: float, shim: str) -> tuple[int, int]:
    """Knock until rank 0 answers: (this worker's rank, the new world size).

    build(rank, world_size) makes a ReducerClient of the job. Each knock
    lasts until the daemons' round timeout fails it; after timeout_s no new
    one starts (so this returns or raises within timeout_s plus one knock).
    """
    deadline = time.monotonic() + timeout_s
    client = _lobby_client(build, 1)
    try:
        while time.monotonic() < deadline:
            key = KNOCK_PREFIX + secrets.token_hex(8)
            future = allreduce_async_on_wire(client, np.zeros(2, np.float32), key, "sum",
                                             "float32")
            try:
                world_size, rank = (int(v) for v in future.result())
            except ReducerError as exc:
                if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                continue  # not answered within the round timeout: knock again
            if not 0 < rank < world_size:
                raise ReducerError(grpc.StatusCode.INTERNAL,
                                   f"{shim}.elastic: a knock's answer {rank} of {world_size} "
                                   "is no rank of a larger world")
            return rank, world_size
    finally:
        client.close()
    raise ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"{shim}.elastic: no running job {client.job!r} admitted this worker "
                       f"within {timeout_s:g} s ({JOIN_TIMEOUT_ENV}); a job admits workers "
                       "at its commits, and the daemons' --stalled-after must be below "
                       "their --round-timeout")


def _open_knocks(client: Any) -> list[tuple[float, str]]:
    """(seconds left before its round timeout, key) of each knock waiting on the daemons."""
    knocks = []
    for link in client.links:
        try:
            reply = link.job_status(client.job)
        except TransportError as exc:
            _log.warning("elastic: status of %s for joiners failed: %s", link.address,
                         exc.code)
            continue
        for chunk in reply.stalled:
            if (chunk.job == client.job and chunk.key.startswith(KNOCK_PREFIX)
                    and chunk.round == 0 and chunk.world_size == 2
                    and list(chunk.missing_ranks) == [0]):
                knocks.append((reply.round_timeout_s - chunk.age_s, chunk.key))
    return knocks


class HostWatch:
    """What commit() asks at every rank: has a worker been admitted? (module doc).

    Made by elastic.run for each incarnation; `build(rank, world_size)`
    makes a ReducerClient of the job. Only rank 0 reads the daemons.
    """

    def __init__(self, reducer: Reducer, build: Any, shim: str) -> None:
        self.reducer, self._build, self.shim = reducer, build, shim
        self._polled_s = float("-inf")
        self._answers: Any = None  # rank 0's lobby client, made at the first answer

    def check(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank alike when a worker was admitted."""
        admitted = self._admit() if self.reducer.rank == 0 else 0
        count = np.array([admitted], np.float32)
        total = allreduce_async_on_wire(self.reducer, count, "elastic/hosts", "sum",
                                        "float32").result()
        if int(total[0]) > 0:
            raise HostsUpdatedInterrupt(int(total[0]))

    def _admit(self) -> int:
        now = time.monotonic()
        if now - self._polled_s < POLL_INTERVAL_S:
            return 0
        self._polled_s = now
        inner = getattr(self.reducer, "inner", self.reducer)
        if not hasattr(inner, "links"):
            return 0  # not a ReducerClient (a LocalGroup): no daemons, no joiners
        knocks = sorted(k for k in _open_knocks(inner) if k[0] > ANSWER_MARGIN_S)
        if not knocks:
            return 0
        world_size = self.reducer.world_size
        key = knocks[-1][1]  # the most time left: least likely to expire meanwhile
        if self._answers is None:
            self._answers = _lobby_client(self._build, 0)
        answer = np.array([world_size + 1, world_size], np.float32)
        try:
            allreduce_async_on_wire(self._answers, answer, key, "sum", "float32").result(
                timeout=ANSWER_TIMEOUT_S)
        except Exception as exc:  # expired meanwhile: that joiner knocks again
            _log.warning("%s: a joiner's knock %s went unanswered: %s", self.shim, key, exc)
            self.close()  # its open round is dropped with the client
            return 0
        _log.warning("%s: a worker joins as rank %d; going on with %d", self.shim,
                     world_size, world_size + 1)
        return 1

    def close(self) -> None:
        if self._answers is not None:
            self._answers.close()
            self._answers = None
