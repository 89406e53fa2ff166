"""Client instances per job: a job restarted under the same id never gets an earlier one's sums.

Contract section 2 (**new**): torchrun's elastic agent restarts every worker
under the same job id, and the new processes count their rounds from 0
again, while the table still holds each chunk's last result for resends (and
rounds the dead workers left open). Every client draws a random non-zero
Shard.incarnation at construction; 0 (an old client) is never checked, as
before. Per job the table keeps the id each rank last contributed with and
an era, the incarnation it serves:

- the same id in the current era: counted as without ids (a resend after a
  broken stream or a daemon restart still gets the cached result);
- a rank seen for the first time: recorded in the current era;
- a new id from a rank recorded in the current era, or a rank seen for the
  first time outside the era's world (rank >= every world size its ranks
  sent: a job restarted larger, whose added ranks may come first) with an
  id no rank of the era holds: the job restarted. (An id the era already
  holds is no new client instance: its contribution is counted as usual, so
  a world size that disagrees fails the chunk with INVALID_ARGUMENT.) A
  new era begins: every open chunk of the job fails for its streams with
  FAILED_PRECONDITION (its contributions are the earlier
  incarnation's), the job's cached results and failures are dropped, and
  the contribution opens its round anew (with summing threads, a round of
  the earlier incarnation complete but still being summed fails too: it
  may not land in the cache the new incarnation reads);
- a new id from a rank recorded in an earlier era: that rank has joined the
  new incarnation (another rank began its era); nothing is dropped, since
  the era holds only what new instances sent;
- an id of before the restart (the rank's record of an earlier era, or an
  id a rank left behind): refused with FAILED_PRECONDITION naming the
  restart, and counted nowhere. A worker that did not restart with the
  others is told so at its next call instead of running out of step.

Bounds: one record per rank (rank < world_size <= --max-world-size), a
count per id of the era, and at most 2 * records + 16 ids left behind, all
dropped with the job's record (reducerd.core.reduction.JOB_FORGET_AFTER_S). A
contribution costs a dict lookup; a restart scans the open chunks, cached
results and failures once, as fail_all does.

What it cannot see: incarnations are told apart by what reaches this
daemon. A rank whose earlier instance never reached this daemon is taken
for a member of the incarnation it finds (its first round may meet a dead
instance's contribution, until its partner's new id starts the new era);
so is a new incarnation's rank that finds an era begun by an incarnation
that died before this rank's earlier instance was replaced here.

This module holds the rule (JobIncarnations.check); the reduction table
acts on its verdict (reducerd.core.reduction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["JobIncarnations", "Restart"]

_RETIRED_SLACK = 16


@dataclass(slots=True)
class _Seen:
    incarnation: int
    era: int
    world_size: int


class Restart(NamedTuple):
    """A new era began with `rank`'s contribution; `reason` says how it showed."""

    rank: int
    reason: str


class JobIncarnations:
    """One job's client instances, per rank (the module doc's rules)."""

    __slots__ = ("era", "restarted_by", "_seen", "_retired", "_world", "_era_ids")

    def __init__(self) -> None:
        self.era = 0
        self.restarted_by: int | None = None  # the rank whose new id began this era
        self._seen: dict[int, _Seen] = {}
        self._retired: dict[int, int] = {}  # id left behind -> its rank; oldest first
        self._world = 0  # the largest world size of a record of this era
        self._era_ids: dict[int, int] = {}  # id -> how many ranks of this era hold it

    def __len__(self) -> int:
        return len(self._seen)

    @property
    def retired_count(self) -> int:
        return len(self._retired)

    def check(self, rank: int, incarnation: int, world_size: int) -> Restart | str | None:
        """None: count the contribution. A str: refuse it (why). A Restart: a
        new era began with it (the caller fails what the earlier one left)."""
        seen = self._seen.get(rank)
        if seen is not None and seen.incarnation == incarnation:
            return None if seen.era == self.era else self._refusal(rank)
        if incarnation in self._retired:
            return self._refusal(rank)
        if seen is None and rank >= self._world and incarnation in self._era_ids:
            # The era's own instance at another world size: no restart; the
            # chunk's usual checks judge the contribution.
            self._record(rank, incarnation, world_size)
            return None
        if seen is not None:
            self._retire(seen.incarnation, rank)
        if (seen is not None and seen.era < self.era) or (
                seen is None and (not self._seen or rank < self._world)):
            # A new member of this era: it joins the incarnation another rank began.
            self._record(rank, incarnation, world_size)
            return None
        reason = ("new client instance" if seen is not None else
                  f"new client instance at world size {world_size}, outside the world of "
                  f"{self._world} the job had")
        self.era += 1
        self._era_ids.clear()
        self._world, self.restarted_by = 0, rank
        self._record(rank, incarnation, world_size)
        return Restart(rank, reason)

    def _record(self, rank: int, incarnation: int, world_size: int) -> None:
        self._seen[rank] = _Seen(incarnation, self.era, world_size)
        self._era_ids[incarnation] = self._era_ids.get(incarnation, 0) + 1
        self._world = max(self._world, world_size)

    def _refusal(self, rank: int) -> str:
        return (f"job restarted under the same job id (rank {self.restarted_by} came back as "
                f"a new client instance); this contribution of rank {rank} comes from a "
                "client instance of before the restart and is refused: restart it too")

    def _retire(self, incarnation: int, rank: int) -> None:
        held = self._era_ids.get(incarnation)
        if held is not None and self._seen[rank].era == self.era:
            if held > 1:
                self._era_ids[incarnation] = held - 1
            else:
                del self._era_ids[incarnation]
        self._retired[incarnation] = rank
        while len(self._retired) > 2 * len(self._seen) + _RETIRED_SLACK:
            del self._retired[next(iter(self._retired))]
