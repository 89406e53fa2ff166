"""LoopOutbox: a C-loop connection's replies, counted in the budget, ends as status frames."""

from __future__ import annotations

import struct

import grpc
import pytest
from reducer_wire.framing import STATUS

from reducerd.core.limits import MemoryBudget
from reducerd.dataplane.cloop import LoopOutbox
from reducerd.dataplane.outbox import GONE
from reducerd.service.session import END


class Reply:
    def __init__(self, nbytes: int) -> None:
        self.frame = bytearray(nbytes)


class FakeLoop:
    """Records what the outbox asks of the C loop; stopped: raises as _cplane.Loop does."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.stopped = False

    def _record(self, *call: object) -> None:
        if self.stopped:
            raise RuntimeError("the C data loop is not running")
        self.calls.append(call)

    def send(self, *args: object) -> None:
        self._record("send", *args)

    def end(self, *args: object) -> None:
        self._record("end", *args)

    def set_job(self, *args: object) -> None:
        self._record("set_job", *args)


def status_of(frame: bytes) -> tuple[int, str]:
    kind, length = struct.unpack_from("<BI", frame)
    assert kind == STATUS and length == len(frame) - 5
    return struct.unpack_from("<I", frame, 5)[0], frame[9:].decode()


@pytest.fixture
def rig():
    budget, loop = MemoryBudget(1 << 20), FakeLoop()
    return budget, loop, LoopOutbox(budget, loop, conn_id=7, fd=11, job=None)


def test_items_put_before_the_connection_is_on_the_loop_wait_for_it(rig):
    budget, loop, outbox = rig
    outbox.put_nowait(Reply(100), 3)
    outbox.put_nowait((grpc.StatusCode.UNAVAILABLE, "reducerd is shutting down"))
    assert loop.calls == [] and budget.transport_bytes == 0
    outbox.attach()
    (send, end) = loop.calls
    assert send[:3] == ("send", 7, 11) and send[4:] == (3, None, 100)
    assert end[:3] == ("end", 7, 11)
    assert status_of(end[3]) == (grpc.StatusCode.UNAVAILABLE.value[0],
                                 "reducerd is shutting down")
    # The reply's bytes count until the C loop gives them back (sent or dropped).
    assert budget.transport_bytes == 100


def test_end_is_an_ok_status_and_gone_puts_nothing(rig):
    _, loop, outbox = rig
    outbox.attach()
    outbox.put_nowait(GONE)
    outbox.put_nowait(END)
    (end,) = loop.calls
    assert status_of(end[3]) == (0, "")


def test_the_job_is_set_once_and_told_to_the_loop(rig):
    budget, loop, outbox = rig
    outbox.attach()
    outbox.job = "a"
    outbox.job = "b"  # fixed once set: what was counted for "a" goes back to "a"
    assert loop.calls == [("set_job", 7, 11, "a")]
    outbox.put_nowait(Reply(64))
    assert loop.calls[-1][5] == "a" and budget.job_transport_bytes("a") == 64


def test_a_stopped_loop_closes_the_outbox_and_gives_the_bytes_back(rig):
    budget, loop, outbox = rig
    outbox.attach()
    loop.stopped = True
    outbox.put_nowait(Reply(500))
    assert outbox.closed and budget.transport_bytes == 0
    outbox.put_nowait(Reply(500))  # nothing more is counted or asked
    assert budget.transport_bytes == 0 and loop.calls == []
