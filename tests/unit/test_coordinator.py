"""The node Coordinator in-process: its protocol over a real Unix socket,
without workers, daemons or NodeGroup.

Each test hosts one coordinator (local rank 0's part) and speaks for the
local workers with raw sockets, one JSON message per line, as
node/coordinator.py documents. Every read is bounded (2 s).
"""

import itertools
import json
import os
import socket

import pytest
from reducer_client.errors import ReducerError
from reducer_client.node.coordinator import Coordinator, encode
from reducer_client.node.shm import SHM_DIR, segment_prefix, socket_address

pytestmark = pytest.mark.timeout(60)
_jobs = itertools.count()


class Peer:
    """One local worker's end of the coordinator socket."""

    def __init__(self, job, node=0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(2.0)
        self.sock.connect(socket_address(job, node))
        self.lines = self.sock.makefile("rb")

    def send(self, *message):
        self.sock.sendall(encode(list(message)))

    def next(self):
        line = self.lines.readline()
        return json.loads(line) if line else None

    def close(self):
        self.lines.close()
        self.sock.close()


NODE_INCARNATION = (1 << 64) - 5  # a 64-bit id survives the JSON line exactly


@pytest.fixture
def node():
    """A coordinator for 2 local workers of 1 node, and a factory of joined peers."""
    job = f"unit-coord-{os.getpid()}-{next(_jobs)}"
    coordinator = Coordinator(job, 0, local_size=2, nodes=1, timeout_s=0.5,
                              incarnation=NODE_INCARNATION)
    peers = []

    def peer(local_rank, local_size=2, nodes=1, welcome=True):
        p = Peer(job)
        peers.append(p)
        p.send("hello", local_rank, local_size, nodes)
        if welcome:
            assert p.next() == ["welcome", NODE_INCARNATION]  # what its shards carry
        return p

    yield job, coordinator, peer
    for p in peers:
        p.close()
    coordinator.close()
    assert _names(job) == []  # close() leaves nothing in /dev/shm


def _names(job):
    return [n for n in os.listdir(SHM_DIR) if n.startswith(segment_prefix(job, 0))]


SIGNATURE = [1000, 1, 1, None]  # elements, wire dtype, op, root rank


def test_a_whole_operation_and_the_segment_reused(node):
    """join -> seg (the same segment for both), wrote by all -> go (and the
    name unlinked: everyone has it mapped), done by all -> result, released by
    all -> the next operation of that size gets the same segment."""
    job, _, peer = node
    a, b = peer(0), peer(1)
    for p in (a, b):
        p.send("join", "k", 0, SIGNATURE)
    seg_a, seg_b = a.next(), b.next()
    assert seg_a[:3] == ["seg", "k", 0] and seg_a == seg_b
    assert _names(job) == [seg_a[3]]
    for p in (a, b):
        p.send("wrote", "k", 0)
    assert a.next() == b.next() == ["go", "k", 0]
    assert _names(job) == []
    for p in (a, b):
        p.send("done", "k", 0)
    assert a.next() == b.next() == ["result", "k", 0]
    for p in (a, b):
        p.send("release", "k", 0)
        # A join answered on the same connection: its release was handled.
        # (Large: it takes a segment of its own, not the one released.)
        p.send("join", "sync", 0, [100_000, 1, 1, None])
        assert p.next()[:3] == ["seg", "sync", 0]
    for p in (a, b):
        p.send("join", "k", 1, SIGNATURE)
    assert a.next() == ["seg", "k", 1, seg_a[3]] == b.next()


def test_local_ranks_that_disagree_fail_the_operation_for_both(node):
    _, _, peer = node
    a, b = peer(0), peer(1)
    a.send("join", "k", 0, SIGNATURE)
    assert a.next()[0] == "seg"
    b.send("join", "k", 0, [2000, 1, 1, None])
    message = b.next()
    assert message[:4] == ["fail", "k", 0, "INVALID_ARGUMENT"]
    assert "local rank 1 has elements 2000 vs 1000" in message[4]
    assert a.next() == message


def test_a_failure_reported_by_one_local_rank_reaches_the_others(node):
    _, _, peer = node
    a, b = peer(0), peer(1)
    for p in (a, b):
        p.send("join", "k", 0, SIGNATURE)
        assert p.next()[0] == "seg"
    a.send("fail", "k", 0, "UNAVAILABLE", "daemon h:1 gone")
    for p in (a, b):
        assert p.next() == ["fail", "k", 0, "UNAVAILABLE", "local rank 0: daemon h:1 gone"]


def test_a_local_rank_that_never_comes_is_named_at_the_timeout(node):
    _, coordinator, peer = node
    a, _ = peer(0), peer(1)
    a.send("join", "k", 0, SIGNATURE)
    assert a.next()[0] == "seg"
    a.send("wrote", "k", 0)
    message = a.next()  # within timeout_s (0.5 s) plus a 0.2 s tick
    assert message[:4] == ["fail", "k", 0, "DEADLINE_EXCEEDED"]
    assert "local rank(s) [1] did not reach key 'k' round 0 within 0.5 s" in message[4]


def test_a_worker_that_dies_aborts_the_node_now_and_later(node):
    """Its socket closes without "bye" (what SIGKILL looks like): the others
    are told at once, and every later join is refused with the same reason."""
    _, _, peer = node
    a, b = peer(0), peer(1)
    a.send("join", "k", 0, SIGNATURE)
    assert a.next()[0] == "seg"
    b.close()
    abort = a.next()
    assert abort[0] == "abort" and "local rank 1" in abort[1]
    assert "disconnected without closing its client" in abort[1]
    a.send("join", "k", 1, SIGNATURE)
    assert a.next() == abort


def test_a_hello_to_an_aborted_coordinator_is_told_to_retry(node):
    """An elastic reset: a local rank rebuilds before local rank 0 replaced
    its aborted coordinator. It is told to retry (a new one comes), with the
    reason once, not refused."""
    _, _, peer = node
    a, b = peer(0), peer(1)
    b.send("bye")
    b.close()
    abort = a.next()
    again = peer(1, welcome=False).next()
    assert again == ["retry", abort[1]]
    assert abort[1].count("node-local aggregation") == 1


def test_a_worker_that_says_bye_is_told_apart(node):
    _, _, peer = node
    a, b = peer(0), peer(1)
    b.send("bye")
    b.close()
    abort = a.next()
    assert abort[0] == "abort" and "closed its client" in abort[1]


def test_hello_with_another_shape_or_a_taken_rank_is_refused(node):
    _, _, peer = node
    peer(0)
    wrong = peer(1, local_size=4, welcome=False).next()
    assert wrong[0] == "abort" and "local rank 1 has local_size 4" in wrong[1]
    taken = peer(0, welcome=False).next()
    assert taken[0] == "abort" and "local rank 0 is already connected" in taken[1]


def test_a_second_coordinator_for_the_same_node_is_refused(node):
    job, _, _ = node
    with pytest.raises(ReducerError, match="another local rank 0 of this job and node"):
        Coordinator(job, 0, local_size=2, nodes=1, timeout_s=1.0)


def test_close_ends_every_connection(node):
    _, coordinator, peer = node
    a = peer(0)
    a.send("join", "k", 0, SIGNATURE)
    assert a.next()[0] == "seg"
    coordinator.close()
    assert a.next() is None  # end of stream: the worker's reader fails what is open


def test_dev_shm_that_cannot_hold_a_new_segment_fails_only_that_operation(node, monkeypatch):
    """Scenario: two keys in flight each pass the free-space check, but tmpfs
    takes pages only when written, so together they would overrun /dev/shm
    and the workers would die of SIGBUS. The coordinator reserves a new
    segment's pages at creation (posix_fallocate): ENOSPC there fails that
    operation with RESOURCE_EXHAUSTED and leaves no name behind; the next
    operation, with room again, gets its segment."""
    import errno

    job, _, peer = node
    a, b = peer(0), peer(1)
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    for p in (a, b):
        p.send("join", "k", 0, SIGNATURE)
    for p in (a, b):
        message = p.next()
        assert message[:4] == ["fail", "k", 0, "RESOURCE_EXHAUSTED"]
        assert "/dev/shm" in message[4]
    assert _names(job) == []
    monkeypatch.setattr(os, "posix_fallocate", real)
    for p in (a, b):
        p.send("release", "k", 0)
        p.send("join", "k", 1, SIGNATURE)
        assert p.next()[:3] == ["seg", "k", 1]


def test_where_pages_cannot_be_reserved_segments_in_use_count_as_taken(node, monkeypatch):
    """Without posix_fallocate (EOPNOTSUPP) the coordinator counts the bytes
    of the segments it created as taken: keys in flight together never get
    more than /dev/shm had free (here 200 KiB; each segment is 64 KiB)."""
    import errno

    from reducer_client.node import pool

    _, _, peer = node
    a = peer(0)
    peer(1)

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    monkeypatch.setattr(pool, "shm_free_bytes", lambda: 200 << 10)
    answers = []
    for index in range(4):
        a.send("join", f"k{index}", 0, SIGNATURE)
        answers.append(a.next()[0])
    assert answers == ["seg", "seg", "seg", "fail"]
