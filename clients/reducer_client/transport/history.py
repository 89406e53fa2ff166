"""What a link keeps per chunk slot (key, offset) between rounds, bounded.

After a daemon restart a client resends its contribution to the last completed
round of each chunk, so that ranks that missed that result get it (contract,
section 2). The daemon keeps a chunk's last result only until the chunk's next
round completes or one round timeout passes, so a contribution that completed
more than a round timeout before the stream was last seen alive can help no
one: it is dropped, as are the oldest beyond MAX_SLOTS. A long run with a new
key per call (an unnamed allreduce) therefore holds at most a round timeout's
worth of them.

The same slots recycle the send buffers: a slot's message of round r becomes
the spare for round r + 2 once round r + 1 has completed and no transport still
holds it (Message.queued == 0): two buffers per slot alternate, no allocation
per chunk in steady state.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from reducer_client.transport.base import HEADROOM

__all__ = ["Message", "SendHistory", "MAX_SLOTS"]

# Per link. At 1 MiB chunks, 64 GiB of one daemon's share of a model.
MAX_SLOTS = 1 << 16

Slot = tuple[str, int]  # (key, offset)


class Message:
    """One encoded shard in its own buffer: HEADROOM bytes, then the Shard."""

    __slots__ = ("buffer", "queued")

    def __init__(self, nbytes: int) -> None:
        # Uninitialised: the encoder writes every byte of the Shard.
        self.buffer = np.empty(HEADROOM + nbytes, dtype=np.uint8)
        # Outboxes holding it whose transport has not yet moved past it; the
        # link's lock guards it. Only a message at 0 may be written again.
        self.queued = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the Shard itself."""
        return self.buffer.size - HEADROOM

    @property
    def frame(self) -> memoryview:
        """What a transport gets: the headroom, then the Shard."""
        return self.buffer.data

    @property
    def shard(self) -> memoryview:
        """The Shard's bytes (writable: the encoder fills them)."""
        return self.buffer.data[HEADROOM:]


class _Slot:
    __slots__ = ("round", "message", "completed_s", "spare")

    def __init__(self, round_: int, message: Message, completed_s: float) -> None:
        self.round, self.message, self.completed_s = round_, message, completed_s
        self.spare: Message | None = None


class SendHistory:
    """Per chunk slot: our contribution to its last completed round, and a
    spare buffer for its next. Not thread-safe: the link's lock guards it."""

    def __init__(self, max_slots: int = MAX_SLOTS) -> None:
        self.max_slots = max_slots
        # The daemon's round timeout, from its brief status; None: not known yet.
        self.round_timeout_s: float | None = None
        # Oldest completion first (each completion moves its slot to the end).
        self._slots: OrderedDict[Slot, _Slot] = OrderedDict()
        # key -> how many of its slots are kept (supersede() finds them at once).
        self._keys: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def message(self, slot: Slot, nbytes: int) -> Message:
        """A buffer for the slot's next contribution: its spare if that fits."""
        entry = self._slots.get(slot)
        if entry is not None and entry.spare is not None and entry.spare.nbytes == nbytes:
            message, entry.spare = entry.spare, None
            return message
        return Message(nbytes)

    def completed(self, slot: Slot, round_: int, message: Message, now_s: float) -> None:
        """The daemon answered `message`, our contribution to round_ of slot."""
        entry = self._slots.get(slot)
        if entry is None:
            self._slots[slot] = _Slot(round_, message, now_s)
            self._keys[slot[0]] = self._keys.get(slot[0], 0) + 1
        elif round_ >= entry.round:
            old = entry.message
            entry.round, entry.message, entry.completed_s = round_, message, now_s
            if old is not message and old.queued == 0:
                entry.spare = old  # no transport holds it, no one will resend it
            self._slots.move_to_end(slot)
        # else: an older round answered late (two calls of one key raced): the
        # newer contribution is what a daemon may still need.
        self.prune(now_s)

    def prune(self, alive_s: float) -> None:
        """Drop what can no longer help: contributions completed more than a
        round timeout before `alive_s` (when the daemon was last seen alive),
        and the oldest beyond max_slots."""
        timeout_s = self.round_timeout_s
        while self._slots:
            slot, entry = next(iter(self._slots.items()))
            expired = timeout_s is not None and entry.completed_s < alive_s - timeout_s
            if not expired and len(self._slots) <= self.max_slots:
                return
            self._drop(slot)

    def _drop(self, slot: Slot) -> None:
        del self._slots[slot]
        left = self._keys[slot[0]] - 1
        if left:
            self._keys[slot[0]] = left
        else:
            del self._keys[slot[0]]

    def supersede(self, key: str, round_: int) -> None:
        """Round round_ of `key` completed elsewhere (the C loop's own
        connection): drop this key's older contributions, which a restarted
        daemon must not be sent; nothing to do (no scan) for a key not kept."""
        if key not in self._keys:
            return
        for slot in [s for s, e in self._slots.items() if s[0] == key and e.round < round_]:
            self._drop(slot)

    def resendable(self, alive_s: float) -> list[Message]:
        """After a break: the contributions a restarted daemon may still need."""
        self.prune(alive_s)
        return [entry.message for entry in self._slots.values()]

    def rounds(self) -> dict[Slot, int]:
        """Slot -> its last completed round (for tests and diagnostics)."""
        return {slot: entry.round for slot, entry in self._slots.items()}
