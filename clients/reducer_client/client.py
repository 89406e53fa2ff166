"""ReducerClient: allreduce and broadcast of NumPy arrays through reducerd daemons.

The facade: it validates a call, counts the key's rounds, cuts the array into
chunks (layout.py) and routes them: through this host's node group (node/)
when workers share it, else to the daemons' links (transport/link.py), each
chunk narrowed straight into its message; an Operation (ops.py) collects replies.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import grpc
import numpy as np
from reducer_wire import convert, dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import MAX_NAME_CHARS
from reducer_wire.layout import Chunk, KeyLayout

from reducer_client import fastpath
from reducer_client.env import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WIRE_DTYPE,
    client_loop_from_env,
    data_plane_from_env,
    link_gbit_from_env,
    local_settings_from_env,
    settings_from_env,
    wire_numpy_from_env,
)
from reducer_client.errors import ReducerError, cause_behind
from reducer_client.integers import INTEGER_INPUTS, integer_wire_for
from reducer_client.node.group import NodeGroup
from reducer_client.node.topology import node_topology
from reducer_client.ops import InFlight, Operation
from reducer_client.sending import send_in_python
from reducer_client.tls import TLSConfig, channel_credentials
from reducer_client.transport.link import DaemonLink

__all__ = ["ReducerClient"]

_INPUT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class ReducerClient:
    """Allreduce NumPy arrays of one job's worker through reducerd daemons.

    Every worker of the job must make the same calls for a key in the same
    order: the client counts rounds per key. An array is cut into chunks that
    are spread over all daemons the same way on every worker, so each worker
    sends each element once and receives each reduced element once.
    Thread-safe; use as a context manager or call close().

    token: sent as `authorization: Bearer <token>`. tls: True for TLS with the
    system's roots, or a TLSConfig (own CA, client certificate for mutual TLS).
    data_plane: "auto" (REDUCER_DATA_PLANE's default) sends over a daemon's TCP
    data plane where it has one (over TLS with tls), else gRPC; "tcp" or "grpc" insist.

    Node-local aggregation (node/): when local_size > 1 workers share this
    host, they reduce together through shared memory and the node sends the
    model once; the daemons see one contribution per node. local_rank and
    local_size default to REDUCER_LOCAL_RANK / REDUCER_LOCAL_SIZE, else
    torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, else one worker per node. Ranks
    must be node-major (node = rank // local_size) unless node_rank (default
    REDUCER_NODE_RANK) names the node. node_local=False (or
    REDUCER_NODE_LOCAL=0) turns it off. rank and world_size stay the worker's.
    incarnation: this instance's random non-zero id in every shard (under node-local
    aggregation, its node's), so that a job restarted under its job id never gets an
    earlier incarnation's sums (contract section 2).

    link_gbit: each worker's link to the daemons, each way, in Gbit/s (default
    REDUCER_LINK_GBIT, else a fast network): what the chunks of a key are sized
    for where chunk_bytes is not given (reducer_wire.layout); the same on every rank.
    environ: where the defaults above come from (and REDUCER_WIRE_NUMPY=1,
    conversions in NumPy instead of C): os.environ unless given; from_env(m)
    passes m, so such a client reads nothing else.
    """

    def __init__(self, addresses: Sequence[str], job: str, rank: int, world_size: int,
                 wire_dtype: str = DEFAULT_WIRE_DTYPE, timeout: float = DEFAULT_TIMEOUT_S,
                 token: str | None = None, chunk_bytes: int | None = None,
                 tls: TLSConfig | bool | None = None, *, local_rank: int | None = None,
                 local_size: int | None = None, node_local: bool | None = None,
                 node_rank: int | None = None, data_plane: str | None = None,
                 link_gbit: float | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a]
        if not addresses:
            raise ValueError("addresses: give at least one daemon address HOST:PORT")
        if not job or len(job) > MAX_NAME_CHARS:
            raise ValueError(f"job: must be a non-empty string of at most {MAX_NAME_CHARS} "
                             f"characters, got {job!r:.80}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        if wire_dtype not in dtypes.WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire_dtype!r}: one of "
                             f"{', '.join(dtypes.WIRE_DTYPES)}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if chunk_bytes is not None and chunk_bytes < 4:
            raise ValueError(f"chunk_bytes must be at least 4, got {chunk_bytes}")
        if link_gbit is not None and not 0 < link_gbit < float("inf"):
            raise ValueError(f"link_gbit must be a link rate in Gbit/s above 0, got {link_gbit}")
        environ = os.environ if environ is None else environ
        self.addresses = list(addresses)
        convert.use_accelerator(not wire_numpy_from_env(environ))
        self.job, self.rank, self.world_size = job, rank, world_size
        self.wire_dtype = wire_dtype
        self.timeout = float(timeout)
        self.link_gbit = link_gbit_from_env(environ) if link_gbit is None else link_gbit
        self._layout = KeyLayout.for_link(len(self.addresses), chunk_bytes, None
                                          if self.link_gbit is None else self.link_gbit * 125e6)
        # What every worker must agree on for daemon i; the daemon checks it per job.
        self._layouts = [self._layout.fingerprint(i) for i in range(len(self.addresses))]
        metadata = [("authorization", f"Bearer {token}")] if token else []
        if tls is True:
            tls = TLSConfig()
        credentials = channel_credentials(tls) if tls else None
        extra_options = ([("grpc.ssl_target_name_override", tls.server_name)]
                         if isinstance(tls, TLSConfig) and tls.server_name else [])
        if data_plane is None:
            data_plane = data_plane_from_env(environ)
        self._links = [DaemonLink(a, metadata, credentials, extra_options, token=token or "",
                                  data_plane=data_plane,
                                  tls=tls if isinstance(tls, TLSConfig) else None)
                       for a in self.addresses]
        # _lock guards _rounds and _closed (caller threads, close()).
        self._lock = threading.Lock()
        self._rounds: dict[str, int] = defaultdict(int)
        self._closed = False
        self.incarnation = secrets.randbits(64) or 1  # Shard.incarnation
        self._node = self._node_group(local_rank, local_size, node_local, node_rank, environ)
        self.incarnation = self._node.incarnation if self._node else self.incarnation
        self._inflight = InFlight(self._timeout_error,
                                  self._node.check_deadlines if self._node else None)
        # Whole keys through the C loop where every link is plain TCP (fastpath.py).
        self._fast: fastpath.FastPath | None = None
        if (client_loop_from_env(environ) and fastpath.available() and convert.accelerated()
                and all(fastpath.plain_tcp(link) is not None for link in self._links)):
            self._fast = fastpath.FastPath(self._links, job, self._layouts)

    def _node_group(self, local_rank: int | None, local_size: int | None,
                    node_local: bool | None, node_rank: int | None,
                    environ: Mapping[str, str]) -> NodeGroup | None:
        """Join this host's node-local aggregation, unless it is off or L = 1."""
        env = local_settings_from_env(environ)  # only for what the caller left out
        if (local_rank is None) != (local_size is None):
            raise ValueError("give local_rank and local_size together")
        if local_rank is None or local_size is None:
            local_rank, local_size = env.get("local_rank", 0), env.get("local_size", 1)
        node_rank = env.get("node_rank") if node_rank is None else node_rank
        node_local = env.get("node_local", True) if node_local is None else node_local
        self.local_rank, self.local_size = local_rank, local_size
        if not node_local or local_size == 1:
            return None
        try:
            topology = node_topology(self.rank, self.world_size, local_rank, local_size,
                                     node_rank)
            return NodeGroup(self.job, topology, self.timeout, self._send_slice,
                             self.incarnation)
        except BaseException:
            for link in self._links:
                link.close()
            raise

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any,
                 ) -> ReducerClient:
        """Build a client from REDUCER_* variables or the launcher's own (env.py).

        environ: that mapping alone is read (default os.environ): every
        setting is passed explicitly, and the mapping for the rest.
        """
        environ = os.environ if environ is None else environ
        settings = settings_from_env(environ)
        settings.update(overrides)
        return cls(**settings, environ=environ)

    @property
    def chunk_bytes(self) -> int:
        """chunk_bytes as given, else the ceiling of the chunks sized for the link."""
        return self._layout.chunk_bytes

    @property
    def transports(self) -> list[str | None]:
        """Per daemon, what the last stream used: "tcp", "grpc", or None before any."""
        return [link.transport for link in self._links]

    @property
    def c_loop(self) -> fastpath.FastPath | None:
        """The C loop that carries whole keys over plain TCP, or None where it is
        off (not built, REDUCER_CLIENT_C_LOOP=0, REDUCER_WIRE_NUMPY=1, gRPC or TLS)."""
        return self._fast

    @property
    def links(self) -> list[DaemonLink]:
        """The link to each daemon, in the order of the addresses (job_status, ...)."""
        return list(self._links)

    # -- public operations --------------------------------------------------

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum", *,
                  out: np.ndarray | None = None, wire_dtype: str | None = None,
                  priority: int = 0) -> np.ndarray:
        """Sum (or average) `array` over all workers; same dtype and shape back."""
        return self.allreduce_async(array, key, op, out=out, wire_dtype=wire_dtype,
                                    priority=priority).result()

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum", *,
                        out: np.ndarray | None = None, wire_dtype: str | None = None,
                        priority: int = 0) -> Future[np.ndarray]:
        """Start an allreduce; the future's result is the reduced array.

        The input is copied (converted to the wire dtype) before this returns,
        so the caller may reuse it at once. The future fails with ReducerError.
        out: a writable C-contiguous array of the input's shape and dtype (it
        may be `array` itself) that receives the result and is the future's
        result, instead of a new array: no fresh pages to fault in per call.
        Its contents are unspecified if the operation fails.
        wire_dtype: this call's wire dtype instead of the client's (every
        rank must give the same for a key's round; the shims' compression=).
        priority: how soon this result is needed beside the others in flight,
        higher first (0, the default, last): its chunks go out before queued
        chunks of lower priority, and the daemons answer them first
        (Shard.priority). Only the order changes; every rank should give the
        same. Not carried through node-local aggregation. Integers: "sum", exact.
        """
        array, wire = np.asarray(array), self.wire_dtype if wire_dtype is None else wire_dtype
        if wire not in dtypes.WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire!r}: one of {', '.join(dtypes.WIRE_DTYPES)}")
        if not (isinstance(priority, int) and 0 <= priority < 1 << 32):
            raise ValueError(f"priority must be an integer in [0, 2**32), got {priority!r}")
        dtype = integer_wire_for(array, op, key)
        return self._start(array, key, dtypes.WIRE_DTYPES[wire] if dtype is None else dtype,
                           dtypes.op_value(op), root_rank=None, out=out, priority=priority)

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray:
        """Return root_rank's `array` on every worker.

        Exact for float16, bfloat16-representable and float32 values: it
        travels as float32 whatever wire_dtype says (float64 input is rounded
        to float32). The root sends its values, the others zeros.
        """
        return self.broadcast_async(array, key, root_rank).result()

    def broadcast_async(self, array: np.ndarray, key: str, root_rank: int = 0,
                        ) -> Future[np.ndarray]:
        if not 0 <= root_rank < self.world_size:
            raise ValueError(f"root_rank {root_rank} must be in [0, {self.world_size})")
        return self._start(array, key, pb.DTYPE_FLOAT32, pb.REDUCE_OP_SUM,
                           root_rank=root_rank)

    def close(self) -> None:
        """Fail what is still open, half-close the streams and close the channels."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inflight.close(ReducerError(grpc.StatusCode.CANCELLED, "client closed"))
        if self._node is not None:
            self._node.close()
        if self._fast is not None:
            self._fast.close()
        for link in self._links:
            link.close()

    def __enter__(self) -> ReducerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------

    def _start(self, array: np.ndarray, key: str, dtype: int, op: int,
               root_rank: int | None, out: np.ndarray | None = None,
               priority: int = 0) -> Future[np.ndarray]:
        if not isinstance(key, str) or not key or len(key) > MAX_NAME_CHARS:
            raise ValueError(f"key must be a non-empty string of at most {MAX_NAME_CHARS} "
                             f"characters, got {key!r:.80}")
        array = np.asarray(array)
        if array.dtype not in _INPUT_DTYPES and dtypes.integer_wire(array.dtype) != dtype:
            raise TypeError(f"key {key!r}: dtype {array.dtype} is not supported; "
                            "use float16, float32 or float64 (allreduce also takes "
                            f"{', '.join(INTEGER_INPUTS)})")
        if self._node is not None and dtype in dtypes.INTEGER_WIRES:
            raise TypeError(f"key {key!r}: integer allreduce ({array.dtype}) is not "
                            "supported with node-local aggregation (its node sums are "
                            "float32); set REDUCER_NODE_LOCAL=0 to reduce integers exactly")
        if out is not None and not (
                isinstance(out, np.ndarray) and out.shape == array.shape
                and out.dtype == array.dtype and out.flags.c_contiguous
                and out.flags.writeable):
            raise ValueError(f"key {key!r}: out must be a writable C-contiguous array of "
                             f"shape {array.shape} and dtype {array.dtype}, got "
                             + (f"shape {out.shape}, dtype {out.dtype}, contiguous "
                                f"{out.flags.c_contiguous}, writable {out.flags.writeable}"
                                if isinstance(out, np.ndarray) else type(out).__name__))
        flat = np.ascontiguousarray(array).reshape(-1)
        if self._node is None:  # before the round is taken: no round lost to a failure here
            result = np.empty(array.shape, dtype=array.dtype) if out is None else out
            chunks = self._layout.plan(flat.size, dtype, key)
        with self._lock:
            if self._closed:
                raise ReducerError(grpc.StatusCode.CANCELLED, "client is closed")
            round_ = self._rounds[key]
            self._rounds[key] = round_ + 1
        contributes = root_rank is None or root_rank == self.rank
        if self._node is not None:
            return self._node.reduce(flat if contributes else None, array.shape,
                                     array.dtype, key, round_, dtype, op, root_rank, out)
        return self._send_chunks(flat if contributes else None, 0, result.reshape(-1),
                                 result, key, round_, dtype, op, chunks, self.rank,
                                 self.world_size, priority).future

    def _send_slice(self, values: np.ndarray, start: int, out: np.ndarray, key: str,
                    round_: int, dtype: int, op: int) -> Operation:
        """Send this node's reduced slice (elements start.. of key) as the node.

        The daemons see rank = node index, world_size = number of nodes; the
        reduced slice lands in out[start:start + values.size].
        """
        assert self._node is not None
        chunks = [Chunk(start + c.offset, c.numel, c.daemon)
                  for c in self._layout.plan(values.size, dtype, f"{key}#{start}")]
        topology = self._node.topology
        return self._send_chunks(values, start, out, out, key,
                                 round_, dtype, op, chunks, topology.node, topology.nodes)

    def _send_chunks(self, values: np.ndarray | None, base: int, out: np.ndarray,
                     result: np.ndarray, key: str, round_: int, dtype: int, op: int,
                     chunks: Sequence[Chunk], rank: int, world_size: int,
                     priority: int = 0) -> Operation:
        """Send values[c.offset - base:] for every chunk c; replies fill out[c.offset:].

        The whole key through the C loop where it can take it (fastpath.py),
        else chunk by chunk on the Python path (sending.py). values=None
        sends -0.0 (x + -0.0 == x, also for x = -0.0): a broadcast's non-root ranks.
        """
        operation = Operation(key, round_, out, result, dtype, chunks,
                              time.monotonic() + self.timeout, self._settled,
                              lambda error: cause_behind(error, self._links))
        if operation.settled:  # no chunks
            return operation
        try:
            self._inflight.add(operation)
            if self._fast is not None and self._fast.send(
                    operation, values, base, list(chunks), rank=rank, world_size=world_size,
                    op=op, priority=priority, incarnation=self.incarnation):
                return operation
            send_in_python(self._links, operation, values, base, chunks, job=self.job,
                           rank=rank, world_size=world_size, op=op, layouts=self._layouts,
                           priority=priority, incarnation=self.incarnation)
        except Exception as exc:  # a bug or MemoryError too: fail it, drop what went out
            operation.fail(exc if isinstance(exc, ReducerError) else ReducerError(
                grpc.StatusCode.INTERNAL, f"key {key!r} round {round_}: sending failed: {exc!r}"))
            if not isinstance(exc, ReducerError):
                raise
        if operation.settled:  # a chunk sent just after its failure dropped the rest: drop it
            self._forget(operation)
        return operation

    def _settled(self, operation: Operation, error: ReducerError | None) -> None:
        """Stop watching the operation; if it failed, drop its chunks from every link."""
        self._inflight.discard(operation)
        if self._fast is not None:
            self._fast.settled(operation, error)
        if error is not None:
            self._forget(operation)

    def _forget(self, operation: Operation) -> None:
        by_link: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
        for chunk in operation.chunks:
            by_link[chunk.daemon].append((operation.key, operation.round, chunk.offset))
        for daemon, keys in by_link.items():
            self._links[daemon].forget(keys)

    def _timeout_error(self, operation: Operation) -> ReducerError:
        where = (f"job {self.job!r} key {operation.key!r} round {operation.round} "
                 f"(rank {self.rank} of {self.world_size})")
        daemons = {chunk.daemon for chunk in operation.chunks}
        broken = [(link, link.last_error) for link in (self._links[d] for d in sorted(daemons))
                  if link.last_error is not None]
        if broken:
            reasons = "; ".join(f"{error}" for _, error in broken)
            first = broken[0][1]
            return ReducerError(first.code if first.retryable else grpc.StatusCode.UNAVAILABLE,
                                f"{where}: cannot reach daemon(s) "
                                f"{', '.join(link.address for link, _ in broken)} within "
                                f"{self.timeout:g} s: {reasons}", retryable=True)
        return ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{where}: no result within {self.timeout:g} s")
