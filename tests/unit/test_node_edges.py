"""NodeGroup's edges without daemons: who it connects to, what it attaches,
where the callers' callbacks run, and how it finds a coordinator that is
going away.

Each test runs the node's workers as NodeGroups in this process (threads),
with a loopback in place of the daemons (nodes=1: the node sum is the
result). Every wait is bounded; every test leaves nothing in /dev/shm.
"""

import itertools
import json
import os
import socket
import threading
import time
from concurrent.futures import Future

import grpc
import numpy as np
import pytest
from reducer_client.errors import ReducerError
from reducer_client.node.group import NodeGroup
from reducer_client.node.shm import SHM_DIR, segment_prefix, socket_address
from reducer_client.node.topology import NodeTopology
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

pytestmark = pytest.mark.timeout(30)
_jobs = itertools.count()
FLOAT32 = pb.DTYPE_FLOAT32
SUM = pb.REDUCE_OP_SUM


class _Sent:
    """What SliceSender returns: a future and a way to stop waiting for it."""

    def __init__(self) -> None:
        self.future: Future = Future()

    def fail(self, error: ReducerError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def loopback(values, start, out, key, round_, dtype, op):
    """One node: the daemons' result is the node's sum."""
    out[start:start + len(values)] = values
    sent = _Sent()
    sent.future.set_result(None)
    return sent


@pytest.fixture
def job():
    name = f"unit-edges-{os.getpid()}-{next(_jobs)}"
    yield name
    leftovers = [n for n in os.listdir(SHM_DIR) if n.startswith(segment_prefix(name, 0))]
    for n in leftovers:
        os.unlink(os.path.join(SHM_DIR, n))
    assert leftovers == []


def group(job, local_rank, local_size=2, timeout_s=2.0, send=loopback):
    return NodeGroup(job, NodeTopology(local_rank, local_size, 0, 1), timeout_s, send)


def groups(job, local_size=2, timeout_s=2.0, send=loopback):
    """Every local rank's NodeGroup, built at once (rank 0 hosts the coordinator)."""
    made = [None] * local_size

    def build(rank):
        made[rank] = group(job, rank, local_size, timeout_s, send)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(local_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(made)
    return made


def reduce(g, values, key, round_=0):
    flat = np.asarray(values, np.float32)
    return g.reduce(flat, flat.shape, np.dtype(np.float32), key, round_, FLOAT32, SUM, None)


def _fake_listener(address):
    """Bind the node's socket before local rank 0 does."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(4)
    listener.settimeout(5)
    return listener


def _serve_fake(listener, answer_join):
    """Welcome a hello, answer a join with the segment `answer_join`."""
    try:
        conn, _ = listener.accept()
        conn.settimeout(5)
        lines = conn.makefile("rb")
        if lines.readline():
            conn.sendall(b'["welcome",0]\n')
        join = lines.readline()
        if join and answer_join is not None:
            _, key, round_, _ = json.loads(join)
            conn.sendall(json.dumps(["seg", key, round_, answer_join]).encode() + b"\n")
        lines.readline()  # hold the connection until the worker hangs up
    except OSError:
        pass


@pytest.mark.skipif(not hasattr(os, "setuid") or os.geteuid() != 0,
                    reason="needs root to run a listener as another user")
def test_a_socket_bound_by_another_user_is_refused(job):
    """Scenario: another local user (nobody) binds the node's abstract socket
    before local rank 0. Local rank 1 connects to it: it must refuse a
    listener of another uid, naming it, instead of taking its segment."""
    address = socket_address(job, 0)  # the victim's: its uid is in the name
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user
        try:
            os.close(ready_r)
            os.setgid(65534)
            os.setuid(65534)
            listener = _fake_listener(address)
            os.write(ready_w, b"x")
            _serve_fake(listener, None)
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(ReducerError) as info:
            g = group(job, 1, timeout_s=2.0)
            g.close()
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "uid 65534" in str(info.value)
    finally:
        os.close(ready_r)
        os.waitpid(pid, 0)


def test_a_segment_outside_the_jobs_prefix_is_never_attached(job):
    """Scenario: the node's socket answers a join with a segment that is not
    this job's and node's (`reducer-<uid>-<job>-n<node>-...`): the worker fails
    the operation and writes nothing into that segment."""
    from multiprocessing.shared_memory import SharedMemory

    foreign = SharedMemory(name=f"other-{os.getpid()}-{next(_jobs)}", create=True, size=4096)
    listener = _fake_listener(socket_address(job, 0))
    server = threading.Thread(target=_serve_fake, args=(listener, foreign.name), daemon=True)
    server.start()
    try:
        g = group(job, 1, timeout_s=1.0)
        try:
            future = reduce(g, [1.0, 2.0, 3.0], "k")
            with pytest.raises(ReducerError, match="not this job's"):
                future.result(5)
            assert bytes(foreign.buf[:64]) == bytes(64)  # nothing written
        finally:
            g.close()
    finally:
        server.join(5)
        listener.close()
        foreign.close()
        foreign.unlink()


def _until(condition, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _results(futures, timeout_s=5.0):
    codes = []
    for future in futures:
        try:
            future.result(timeout_s)
            codes.append("ok")
        except ReducerError as exc:
            codes.append(exc.code.name)
    return codes


def _held(job, made):
    """What still holds shared memory: names in /dev/shm, the coordinator's, each worker's."""
    names = [n for n in os.listdir(SHM_DIR) if n.startswith(segment_prefix(job, 0))]
    return names, len(made[0]._coordinator._segments), [len(g._segments) for g in made]


def test_a_failed_operation_gives_back_its_segment_once_every_rank_let_go(job):
    """Scenario: local ranks disagree on a key's size (fails before every
    rank wrote: the segment is still named), then a key's daemon phase fails
    (after: unlinked, but mapped by every worker). Once every local rank
    released the failed operation the coordinator unlinks and unmaps its
    segment and tells the workers to forget it; before, each failure kept
    one for the client's whole life."""
    made = groups(job)
    try:
        futures = [reduce(g, np.ones(1000 * (1 + r)), "mismatch") for r, g in enumerate(made)]
        assert _results(futures) == ["INVALID_ARGUMENT"] * 2
        assert _until(lambda: _held(job, made) == ([], 0, [0, 0])), _held(job, made)

        def down(values, start, out, key, round_, dtype, op):
            sent = _Sent()
            sent.fail(ReducerError(grpc.StatusCode.UNAVAILABLE, "daemon gone"))
            return sent

        for g in made:
            g._send_slice = down
        futures = [reduce(g, np.ones(1 << 16), "down") for g in made]
        assert "UNAVAILABLE" in _results(futures)
        assert _until(lambda: _held(job, made) == ([], 0, [0, 0])), _held(job, made)
        for g in made:
            g._send_slice = loopback
        futures = [reduce(g, [1.0, 2.0], "good") for g in made]  # the node still works
        assert [f.result(5).tolist() for f in futures] == [[2.0, 4.0]] * 2
    finally:
        for g in reversed(made):
            g.close()


def test_a_callback_that_reduces_again_does_not_stall_the_node(job):
    """Scenario: a done-callback of one reduction runs another (blocking)
    reduction, as a shim chaining steps may. Callbacks used to run on the
    node's one work thread, which also sums the slices and copies results
    out, so the second reduction waited for the thread its callback held:
    it hung past every timeout. It completes now."""
    made = groups(job)
    second = {}

    def again(rank):
        def callback(_):
            try:
                second[rank] = reduce(made[rank], [1.0, 2.0], "second").result(2).tolist()
            except Exception as exc:  # noqa: BLE001 - reported by the assert below
                second[rank] = repr(exc)
        return callback

    try:
        futures = [reduce(g, [1.0], "first") for g in made]
        for rank, future in enumerate(futures):
            future.add_done_callback(again(rank))
        assert [f.result(5).tolist() for f in futures] == [[2.0]] * 2
        assert _until(lambda: len(second) == 2, 4.0)
        assert second == {0: [2.0, 4.0], 1: [2.0, 4.0]}
    finally:
        for g in reversed(made):
            g.close()


def test_a_local_rank_that_rebuilds_first_waits_for_the_new_coordinator(job):
    """Scenario: an elastic reset closes and rebuilds every local rank's
    client. Local rank 1 rebuilds while local rank 0 still hosts the old,
    aborted coordinator: it used to be refused at once (FAILED_PRECONDITION);
    now it retries until local rank 0's new coordinator welcomes it."""
    made = groups(job)
    made[1].close()
    rebuilt = {}

    def rebuild():
        try:
            rebuilt[1] = group(job, 1, timeout_s=3.0)
        except ReducerError as exc:
            rebuilt[1] = exc

    thread = threading.Thread(target=rebuild)
    thread.start()
    try:
        time.sleep(0.3)  # local rank 1 meets the old coordinator meanwhile
        made[0].close()
        rebuilt[0] = group(job, 0, timeout_s=3.0)
        thread.join(5)
        assert isinstance(rebuilt[1], NodeGroup), rebuilt[1]
        futures = [reduce(rebuilt[r], [1.0], "k") for r in range(2)]
        assert [f.result(5).tolist() for f in futures] == [[2.0]] * 2
    finally:
        thread.join(5)
        for g in (rebuilt.get(1), rebuilt.get(0)):
            if isinstance(g, NodeGroup):
                g.close()


def test_a_coordinator_that_hangs_up_during_the_hello_is_retried(job):
    """The race behind the rebuild test's rare UNAVAILABLE "Connection reset by
    peer" under load: the old coordinator, closing, shut the connections it
    had accepted but not answered, and the worker gave up at once instead of
    retrying as for "retry". Here a listener on the node's socket accepts each
    hello and closes it unread (a reset) or with no answer, for 0.6 s; then a
    real local rank 0 starts. Local rank 1 must get in."""
    address = socket_address(job, 0)
    hangups = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hangups.bind(address)
    hangups.listen(16)
    hangups.settimeout(0.05)
    closed = {"reset": 0, "no answer": 0}
    stop_at = time.monotonic() + 0.6

    def hang_up():
        while time.monotonic() < stop_at:
            try:
                conn, _ = hangups.accept()
            except TimeoutError:
                continue
            if sum(closed.values()) % 2:  # read the hello, answer nothing
                conn.recv(1 << 16)
                closed["no answer"] += 1
            else:
                closed["reset"] += 1  # unread: the worker's read gets ECONNRESET
            conn.close()
        hangups.close()

    rebuilt = {}

    def local_rank_1():
        try:
            rebuilt[1] = group(job, 1, timeout_s=4.0)
        except ReducerError as exc:
            rebuilt[1] = exc

    hanger = threading.Thread(target=hang_up)
    hanger.start()
    worker = threading.Thread(target=local_rank_1)
    worker.start()
    hanger.join(5)
    try:
        rebuilt[0] = group(job, 0, timeout_s=4.0)
        worker.join(6)
        assert isinstance(rebuilt[1], NodeGroup), rebuilt[1]
        assert closed["reset"] and closed["no answer"], closed
        futures = [reduce(rebuilt[r], [1.0], "k") for r in range(2)]
        assert [f.result(5).tolist() for f in futures] == [[2.0]] * 2
    finally:
        worker.join(5)
        for g in (rebuilt.get(1), rebuilt.get(0)):
            if isinstance(g, NodeGroup):
                g.close()


_CLOSE_UNDER_ROWS_SCRIPT = """
import numpy as np
from reducer_client.node.group import _NodeOp
from reducer_client.node.shm import close_segment, create_segment, unlink_segment

numel, local_size = 1 << 16, 2
shm = create_segment(f"reducer-test-rows-{__import__('os').getpid()}", (local_size + 2) * numel * 4)
unlink_segment(shm)  # the name goes now; the mapping stays while used
op = _NodeOp("k", 0, numel, (numel,), np.dtype(np.float32), 1, 1, 0.0)
op.segment = shm
rows = op.rows(local_size)
rows[:] = 1.0
close_segment(shm)  # the client closing while a thread still reads its slice
print(float(rows.sum()))
"""


def test_closing_a_segment_keeps_it_mapped_while_its_rows_are_read():
    """Rows of np.ndarray(buffer=shm.buf) held no export of the buffer: closing
    the segment (the client closing, or a failed op's segment forgotten) unmapped
    it under the node group's work thread, which then died of SIGSEGV reading its
    slice (seen in test_node_local's killed-worker case under load). In a child
    process, since the failure is a crash."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CLOSE_UNDER_ROWS_SCRIPT],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert float(done.stdout) == 4 * (1 << 16)
