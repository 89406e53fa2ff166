"""The daemon object: builds the gRPC server from a Config, serves, drains.

Nothing starts on import. `Daemon(config).serve()` serves until SIGTERM or
SIGINT, then drains: health goes NOT_SERVING, new streams are refused, open
rounds get `drain_grace_s` to finish, what is left fails with UNAVAILABLE,
and the server stops. SIGHUP reloads: the token file (the previous token
honoured for `token_grace_s`) and the settings in config.RELOADABLE, with
every open round and stream carried on.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.tls import server_context

from reducerd.core.limits import TRANSPORT_RESERVE_SHARE, MemoryBudget
from reducerd.core.reduction import UNAVAILABLE, ReductionTable
from reducerd.core.summing_c import summing_pool
from reducerd.daemon.grpc_peers import SCAN_PERIOD_S, UnauthenticatedGuard
from reducerd.daemon.grpc_service import ReducerServicer
from reducerd.daemon.reload import reload_daemon
from reducerd.dataplane import plane as data_plane_module
from reducerd.dataplane.plane import DataPlane
from reducerd.ops.binding import add_port
from reducerd.ops.busy import SAMPLE_S, BusyGate
from reducerd.ops.config import Config, ConfigError
from reducerd.ops.descriptors import DescriptorError, DescriptorPlan, plan_descriptors
from reducerd.ops.memory import HeapTrimmer
from reducerd.ops.notify import Notifier
from reducerd.ops.receive_buffers import ReceiveBuffers
from reducerd.service.access import Access
from reducerd.service.session import Session

if TYPE_CHECKING:
    from reducerd.ops.metrics import Metrics

__all__ = ["Daemon"]

log = logging.getLogger("reducerd")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Reducer"].full_name
# gRPC connections open at once, with or without a call (health and
# reflection need no token, so anyone reaching the port can open them); gRPC
# closes the ones beyond at once. An idle one holds about 17 KiB of the
# daemon's memory (a raw TCP connection 11 KiB), so 8,192 hold about 140 MiB,
# as the data plane's 4,096 do; without a cap they grew with every
# connection opened until the descriptors ran out (LimitNOFILE 65,536 in the
# systemd units: about 1 GiB). Workers need one each per daemon, beside
# their data connections. Unauthenticated ones keep to a share of it
# (reducerd.grpc_peers), and connections without a call are closed after
# --grpc-idle-timeout (grpc.max_connection_idle_ms: measured to close raw
# and HTTP/2-handshaked connections alike in grpcio's server, as
# grpc.max_connection_age_ms does for every connection and
# grpc.server_handshake_timeout_ms for those short of the HTTP/2 handshake).
# Under a low descriptor limit both caps are sized below it (reducerd.ops.descriptors).
MAX_GRPC_CONNECTIONS = 8192
TRIM_PERIOD_S = 1.0  # how often the heaps' free memory may be given back (_trim_loop)


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Refuse calls without `authorization: Bearer <token>`, the daemon token or a
    job token (reducerd.service.access, constant-time); which jobs a job token reaches
    the servicer checks."""

    def __init__(self, access: Access) -> None:
        self._access = access

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)  # probes carry no token
        if self._access.grant_for_metadata(details.invocation_metadata) is not None:
            return await continuation(details)
        return _deny(details.method)


def _deny(method: str):
    async def abort(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong token: send metadata "
                            "'authorization: Bearer <token>'")
    if method.endswith("/Reduce"):
        return grpc.stream_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class Daemon:
    """One reducer daemon built from a validated Config."""

    def __init__(self, config: Config, notifier: Notifier | None = None,
                 reload_config: Callable[[], Config] | None = None) -> None:
        """`reload_config`: the configuration as it stands now, for SIGHUP
        (the command line and --config file read again); by default the same
        Config, so SIGHUP re-reads the token file alone."""
        self.config = config
        self._reload_config = reload_config or (lambda: self.config)
        self.access = Access(None)  # the token: read by start(), rotated by reload()
        convert.use_accelerator(not config.wire_numpy)
        # One count of what the daemon holds: accumulators, receive buffers, unsent replies.
        self.budget = MemoryBudget(config.max_inflight_bytes,
                                   transport_reserve_bytes=config.max_inflight_bytes
                                   // TRANSPORT_RESERVE_SHARE)
        # Summing threads (--threads N); with 1 the loop thread sums inline.
        self.summing = (summing_pool(config.threads, min_chunk_bytes=config.pool_chunk_bytes,
                                     budget_bytes=config.max_inflight_bytes)
                        if config.threads > 1 else None)
        self.table = ReductionTable(config.round_timeout_s, config.max_inflight_bytes,
                                    summing=self.summing,
                                    max_open_chunks_per_job=config.max_open_chunks_per_job,
                                    max_job_inflight_bytes=config.job_inflight_bytes,
                                    budget=self.budget,
                                    job_forget_after_s=config.job_idle_expiry_s,
                                    max_record_bytes=config.max_record_bytes)
        self.session = Session(self.table, max_world_size=config.max_world_size)
        self.servicer = ReducerServicer(self.session, stalled_after_s=config.stalled_after_s,
                                        send_timeout_s=config.round_timeout_s,
                                        status_max_jobs=config.status_max_jobs)
        # systemd's notify socket; a no-op outside a Type=notify unit.
        self.notifier = notifier or Notifier.from_config(config)
        self.metrics: Metrics | None = None
        self.health: health.aio.HealthServicer | None = None  # made by start()
        self.port: int | None = None
        self.data_plane: DataPlane | None = None
        self._stop = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._bind_guard: socket.socket | None = None  # held while serving (binding.py)
        self.guard: UnauthenticatedGuard | None = None  # made by start() (grpc_peers.py)
        self.descriptors: DescriptorPlan | None = None  # sized by start()

    async def start(self) -> int:
        """Bind and start serving; return the bound port."""
        cfg = self.config
        if self.summing is not None and not self.summing.started:
            loop = asyncio.get_running_loop()
            self.summing.start(loop.call_soon_threadsafe, loop.add_reader)
        if cfg.metrics_address:
            self._start_metrics(cfg.metrics_address)
        token = cfg.auth_token()
        self.access = Access(token)
        self.descriptors = self._plan_descriptors()
        # Before the gRPC server exists: a taken data port stops us cleanly.
        self._start_data_plane(token)
        try:
            return await self._start_grpc(token)
        except BaseException:
            if self.data_plane is not None:
                self.data_plane.stop()
            raise

    async def _start_grpc(self, token: str | None) -> int:
        cfg = self.config
        interceptors = []
        self.servicer.access = access = self.access
        if access.required:
            interceptors.append(_TokenAuth(access))
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.max_allowed_incoming_connections", self._grpc_cap),
            ("grpc.max_connection_idle_ms", int(cfg.grpc_idle_timeout_s * 1000)),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        server.add_generic_rpc_handlers((self.servicer.handler(),))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        if cfg.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(_read(cfg.tls_key), _read(cfg.tls_cert))],
                root_certificates=_read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
                require_client_auth=bool(cfg.tls_client_ca))
        else:
            credentials = None
        # Exactly the address asked for: 0.0.0.0 must not mean [::] too (reducerd.ops.binding).
        self.port, self._bind_guard = add_port(server, cfg.listen_address, credentials)
        await server.start()
        self._server = server
        self.guard = UnauthenticatedGuard(self.port, self._grpc_cap)
        self.servicer.on_authenticated = self.guard.note_authenticated
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        host = cfg.listen_address.rpartition(":")[0]
        log.info("listening on %s:%d%s%s", host, self.port, " (TLS)" if cfg.tls_cert else "",
                 " (token required)" if token else "")
        if cfg.data_address is not None:
            log.info("data plane on %s:%d", cfg.data_address[0], self.servicer.data_port)
        return self.port

    def _plan_descriptors(self) -> DescriptorPlan:
        """Raise RLIMIT_NOFILE where it may, size both planes' caps below it, log it."""
        try:
            plan = plan_descriptors(data_plane_module.MAX_CONNECTIONS, MAX_GRPC_CONNECTIONS,
                                    data_plane_module.MAX_HANDSHAKING)
        except DescriptorError as exc:
            raise ConfigError(str(exc)) from None  # exit 2: a restart would not help
        (log.warning if plan.sized_down else log.info)("%s", plan.describe())
        return plan

    @property
    def _grpc_cap(self) -> int:
        return (self.descriptors.grpc_connections if self.descriptors is not None
                else MAX_GRPC_CONNECTIONS)

    def _start_data_plane(self, token: str | None) -> None:
        address = self.config.data_address
        if address is None:
            return
        cfg = self.config
        plan = self.descriptors
        buffers = ReceiveBuffers(cfg.max_inflight_bytes)
        self.data_plane = DataPlane(self.session, asyncio.get_running_loop(), self.access,
                                    cfg.max_message_bytes, send_timeout_s=cfg.round_timeout_s,
                                    tls_context=self._tls_context("the data plane"),
                                    max_connections=plan.data_connections if plan else None,
                                    receive_buffers=buffers,
                                    cap_note=plan.cap_note() if plan else "the daemon's cap",
                                    data_loop=cfg.data_loop)
        self.servicer.data_port = self.data_plane.start(*address)
        log.info("data plane: %s", buffers.describe())

    def _tls_context(self, what: str) -> ssl.SSLContext | None:
        """The daemon's certificate (and client CA) for TLS beside gRPC's, or None."""
        cfg = self.config
        if not (cfg.tls_cert and cfg.tls_key):
            return None
        try:
            return server_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise RuntimeError(f"tls_cert / tls_key / tls_client_ca: cannot load them for "
                               f"{what}: {exc}") from None

    def _start_metrics(self, address: str) -> None:
        from reducerd.ops.metrics import Metrics  # prometheus-client only when asked for
        from reducerd.ops.metrics_http import read_basic_auth

        cfg = self.config
        try:
            auth = read_basic_auth(cfg.metrics_auth_file) if cfg.metrics_auth_file else None
        except (OSError, ValueError) as exc:
            raise RuntimeError(str(exc)) from None
        self.metrics = Metrics(self.table, self.session, max_jobs=cfg.metrics_max_jobs,
                               stalled_after_s=cfg.stalled_after_s)
        self.session.observer = self.metrics
        self.metrics.start_http(address, asyncio.get_running_loop(),
                                ssl_context=self._tls_context("the metrics endpoint"),
                                basic_auth=auth)

    async def serve(self, on_ready: Callable[[int], None] | None = None) -> None:
        """Start, serve until stop() (or a signal), then drain and stop."""
        # Before start() logs "listening": a SIGTERM right after it drains, not kills.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        try:
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        except (NotImplementedError, RuntimeError):
            pass
        await self.start()
        if on_ready is not None and self.port is not None:
            on_ready(self.port)
        # Only now: the port answers and health says SERVING.
        self.notifier.ready(f"serving on port {self.port}")
        tasks = [asyncio.create_task(self._expire_loop()),
                 asyncio.create_task(self.notifier.watchdog_loop()),
                 asyncio.create_task(self._trim_loop()),
                 asyncio.create_task(self._busy_loop()),
                 asyncio.create_task(self._guard_loop())]
        await self._stop.wait()
        await self._drain()
        for task in tasks:
            task.cancel()

    def stop(self) -> None:
        """Ask the daemon to drain and stop (safe from a signal handler)."""
        self._stop.set()

    def reload(self) -> list[str]:
        """SIGHUP: the configuration and token file read again, what may change
        applied (reducerd.daemon.reload); the changes, for tests."""
        return reload_daemon(self, self._reload_config)

    async def _expire_loop(self) -> None:
        """Expire chunks and idle streams every tick, for as long as the daemon
        serves: a fault in one tick (even a MemoryError) is logged, never the
        end of round timeouts."""
        period_s = min(0.2, self.config.round_timeout_s / 10)
        while True:
            await asyncio.sleep(period_s)
            try:
                self.session.expire(self.config.stream_idle_timeout_s)
            except Exception:
                log.exception("reducerd fault while expiring chunks and streams; "
                              "trying again in %g s", period_s)

    async def _guard_loop(self) -> None:
        """Every SCAN_PERIOD_S, off the loop thread: unauthenticated gRPC
        connections past their deadline or share are shut down (grpc_peers)."""
        guard = self.guard
        if guard is None or not guard.available:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SCAN_PERIOD_S)
            try:
                await loop.run_in_executor(None, guard.scan)
            except Exception:
                log.exception("reducerd fault while checking the gRPC connections")

    async def _busy_loop(self) -> None:
        """Every SAMPLE_S: whether new chunks go to the summing threads (reducerd.ops.busy)."""
        if self.summing is None:
            return
        gate = BusyGate(self.config.pool_busy_cores)
        self.summing.busy = gate.busy
        while True:
            await asyncio.sleep(SAMPLE_S)
            busy = gate.sample()
            if busy != self.summing.busy:
                log.debug("new chunks summed %s (the daemon used %.2f cores)",
                          "on the summing threads" if busy else "inline", gate.cores)
            self.summing.busy = busy

    async def _trim_loop(self) -> None:
        """Once a second: give the heaps' free memory back when idle or at a
        limit (memory.HeapTrimmer), off the loop thread."""
        trimmer = HeapTrimmer()
        if not trimmer.available:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TRIM_PERIOD_S)
            try:
                await loop.run_in_executor(None, trimmer.trim_if_due, self.budget.held_bytes,
                                           self.budget.pressure)
            except Exception:
                log.exception("reducerd fault while trimming the heaps")

    async def _drain(self) -> None:
        grace_s = self.config.drain_grace_s
        self.notifier.stopping(f"draining {self.table.open_chunk_count} open chunk(s)")
        log.info("draining: %d open chunk(s), up to %g s", self.table.open_chunk_count,
                 grace_s)
        assert self._server is not None and self.health is not None
        await self.health.enter_graceful_shutdown()
        self.session.draining = True
        self.table.accepting_new_chunks = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.table.open_chunk_count and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.table.open_chunk_count:
            log.warning("failing %d open chunk(s) still incomplete after %g s",
                        self.table.open_chunk_count, grace_s)
            self.session.fail_all(UNAVAILABLE, "daemon shut down before the round completed")
        if self.summing is not None:  # failed chunks' queued adds run (or skip) first
            await asyncio.to_thread(self.summing.close)
        await asyncio.sleep(0.05)  # let the outboxes flush
        if self.data_plane is not None:
            self.data_plane.stop()
        await self._server.stop(grace=1.0)
        if self._bind_guard is not None:
            self._bind_guard.close()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop_http)
        log.info("stopped")


def _read(path: str | None) -> bytes:
    assert path
    with open(path, "rb") as f:
        return f.read()

