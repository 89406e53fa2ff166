"""A local worker's connection to its node's coordinator (local rank 0).

The socket's name is predictable (shm.socket_address), and on Linux it is in
the abstract namespace, which has no file permissions: another local user can
bind it first. So the worker checks who listens (SO_PEERCRED) before it says
anything, and attaches only segments of its own job and node (group.py).

A coordinator that is going away (its node aborted: a local rank closed its
client for an elastic reset, say) answers a hello with ["retry", why], or
closes the connection before it answers: the worker then retries, as while
local rank 0 starts, until its deadline.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

import grpc

from reducer_client.errors import ReducerError
from reducer_client.node.coordinator import encode
from reducer_client.node.shm import socket_address
from reducer_client.node.topology import NodeTopology

__all__ = ["connect", "listener_uid"]

_CONNECT_RETRY_S = 0.05


def listener_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end (None where the OS cannot tell)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


def connect(job: str, topo: NodeTopology, timeout_s: float) -> tuple[socket.socket, int]:
    """Connect to local rank 0's socket (retrying while it starts) and say hello.

    Returns the socket and the node's incarnation (local rank 0's).
    Raises PERMISSION_DENIED if another user listens on the node's socket,
    FAILED_PRECONDITION if the coordinator refuses us (another local size,
    our local rank taken), UNAVAILABLE if none answers by the deadline.
    """
    deadline = time.monotonic() + timeout_s
    where = f"node-local aggregation, job {job!r} node {topo.node}"
    why = "local rank 0 did not open the node's socket"
    while True:
        answer = _hello(job, topo, deadline, where)
        if answer is not None and answer[0] != "retry":
            break
        if answer is not None:  # the reason names job and node already
            reason = str(answer[1]).removeprefix(f"{where}: ")
            why = f"no new coordinator replaced the one going away ({reason})"
        if time.monotonic() >= deadline:
            raise ReducerError(
                grpc.StatusCode.UNAVAILABLE,
                f"{where}: {why} within {timeout_s:g} s (is it running, with the same job "
                "and local size? REDUCER_NODE_LOCAL=0 turns node-local aggregation off)")
        time.sleep(_CONNECT_RETRY_S)
    sock, message = answer[1], answer[2]
    if message[0] != "welcome":
        sock.close()
        raise ReducerError(grpc.StatusCode.FAILED_PRECONDITION, message[1])
    return sock, int(message[1]) if len(message) > 1 else 0


def _hello(job: str, topo: NodeTopology, deadline: float, where: str) -> list | None:
    """One try: None (nobody listens), ["retry", why], or ["ok", socket, answer]."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_address(job, topo.node))
    except OSError:
        sock.close()
        return None
    uid = listener_uid(sock)
    if uid is not None and uid != os.getuid():
        sock.close()  # before a word is said: its segments are not ours to write
        raise ReducerError(grpc.StatusCode.PERMISSION_DENIED,
                           f"{where}: the node's socket is held by uid {uid}, not by this "
                           f"user (uid {os.getuid()}): another user bound it first; "
                           "refusing to share memory with it (REDUCER_NODE_LOCAL=0 turns "
                           "node-local aggregation off)")
    sock.settimeout(max(0.1, deadline - time.monotonic()))
    try:
        sock.sendall(encode(["hello", topo.local_rank, topo.local_size, topo.nodes]))
        line = sock.makefile("rb").readline()
    except OSError as exc:
        # A coordinator going away closes the sockets it has not answered
        # (a reset, as our hello is unread): like its "retry", a new one may
        # come; connect() retries until its deadline and then names this.
        sock.close()
        return ["retry", f"local rank 0 hung up during the hello: {exc}"]
    sock.settimeout(None)
    if not line:
        sock.close()
        return ["retry", "local rank 0 hung up during the hello"]
    message = json.loads(line)
    if message[0] == "retry":
        sock.close()
        return message
    return ["ok", sock, message]
