"""The daemon's one typed configuration: defaults, TOML file, command line.

Precedence: command-line flag > TOML file (--config) > default. Everything is
checked once, here, with errors that name the offending option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from reducerd.core.limits import MAX_OPEN_CHUNKS_PER_JOB, job_inflight_limit
from reducerd.ops.busy import DEFAULT_POOL_BUSY_CORES
from reducerd.ops.options import (
    _FLAGS,
    _HELP,
    DATA_LOOPS,
    DEFAULT_DATA_LOOP,
    DEFAULT_LISTEN,
    DEFAULT_MAX_WORLD_SIZE,
    DEFAULT_POOL_CHUNK_BYTES,
    MAX_THREADS,
    RELOADABLE,
    STALLED_AFTER_S,
    WORLD_SIZE_FIELD_MAX,
    available_cpus,
)
from reducerd.ops.token_file import TokenFileError, read_token_file

__all__ = ["Config", "ConfigError", "add_arguments", "config_from_args", "parse_host_port",
           "DEFAULT_LISTEN", "STALLED_AFTER_S", "MAX_OPEN_CHUNKS_PER_JOB",
           "DEFAULT_MAX_WORLD_SIZE", "MAX_THREADS", "RELOADABLE", "available_cpus"]

GiB = 1 << 30
MiB = 1 << 20

class ConfigError(ValueError):
    """An option is missing, unknown or out of range; the message names it."""


@dataclass(frozen=True)
class Config:
    listen: str = DEFAULT_LISTEN
    metrics_listen: str | None = None
    # One line USER:PASSWORD: /metrics then wants HTTP basic auth with them.
    metrics_auth_file: str | None = None
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    round_timeout_s: float = 60.0
    max_inflight_bytes: int = 2 * GiB
    # Largest Shard accepted; clients send 1 MiB chunks by default.
    max_message_bytes: int = 64 * MiB
    # How long SIGTERM waits for open rounds before failing them.
    drain_grace_s: float = 30.0
    log_level: str = "info"
    # Added to the listen and metrics ports: reducerd@N.service runs with --port-offset N.
    port_offset: int = 0
    # Name of a systemd credential (LoadCredential=NAME:...) holding the token.
    auth_token_credential: str | None = None
    # Jobs with their own metrics label; later jobs are counted as reducer_job="other".
    metrics_max_jobs: int = 20
    # GetStatus lists open chunks older than this as stalled.
    stalled_after_s: float = STALLED_AFTER_S
    # Open chunks one job may hold at once (beyond: RESOURCE_EXHAUSTED).
    max_open_chunks_per_job: int = MAX_OPEN_CHUNKS_PER_JOB
    # Accumulator bytes one job's open chunks may hold; 0: half of max_inflight_bytes.
    max_inflight_bytes_per_job: int = 0
    # What the open chunks' records (ids, names, per-chunk bookkeeping) may
    # hold, beside --max-inflight-bytes; one job half; 0: 1/8 of max_inflight_bytes.
    max_record_bytes: int = 0
    # Largest world_size a shard may declare (beyond: INVALID_ARGUMENT); at most 2^32-1.
    max_world_size: int = DEFAULT_MAX_WORLD_SIZE
    # A stream with nothing open and no message for this long is ended (OK);
    # clients open a new one when they next send.
    stream_idle_timeout_s: float = 600.0
    # The TCP data plane (reducer_wire.framing): "auto" = the listen host on
    # any free port (GetStatus tells clients which), HOST:PORT, or "off". Under
    # TLS it is served over TLS, with the same certificate and client CA.
    data_listen: str = "auto"
    # What reads plain-TCP data-plane frames and sends their replies: "c", a C
    # thread (reducerd.dataplane.cloop; the event loop where it is not built),
    # or "python", the event loop (reducerd.dataplane.loop_reader). TLS
    # connections keep their reader and writer threads either way.
    data_loop: str = DEFAULT_DATA_LOOP
    # Summing threads (reducerd.core.summing); 1: the event loop's thread sums inline.
    threads: int = field(default_factory=available_cpus)
    # With threads > 1: chunks of at least this many wire bytes per contribution
    # are summed on the summing threads, smaller ones inline on the loop thread
    # (a hand-off there and back costs the CPU of adding 100-200 KiB; 0: all).
    pool_chunk_bytes: int = DEFAULT_POOL_CHUNK_BYTES
    # With threads > 1: pool new chunks only while the daemon is this busy (reducerd.ops.busy).
    pool_busy_cores: float = DEFAULT_POOL_BUSY_CORES
    # SIGHUP: how long the token it replaces (and its job tokens) still authorize.
    token_grace_s: float = 300.0
    # A job with nothing open and no shard for this long is forgotten (its
    # status row and counters); its next shard starts it afresh.
    job_idle_expiry_s: float = 300.0
    # GetStatus lists this many jobs at most (the most active first) unless the
    # request asks for more (StatusRequest.max_jobs); the rest are counted.
    status_max_jobs: int = 100
    # gRPC connections that have carried no call for this long are closed
    # (GOAWAY; clients reconnect when they next call): idle ones, a token or
    # not, cannot fill --max-grpc-connections for ever.
    grpc_idle_timeout_s: float = 30.0
    # Not an option: REDUCER_WIRE_NUMPY=1 sums and converts in NumPy instead of
    # reducer_wire's C kernels (same results; for comparison and debugging).
    wire_numpy: bool = False
    # Not an option: $CREDENTIALS_DIRECTORY, set by systemd when the unit loads credentials.
    credentials_directory: str | None = None
    # Not options: systemd's notify socket ($NOTIFY_SOCKET) and watchdog period
    # ($WATCHDOG_USEC, unless $WATCHDOG_PID names another process), for Type=notify units.
    notify_socket: str | None = None
    watchdog_s: float | None = None

    @property
    def job_inflight_bytes(self) -> int:
        """What one job's open chunks may hold: max_inflight_bytes_per_job, or half the limit."""
        return job_inflight_limit(self.max_inflight_bytes, self.max_inflight_bytes_per_job)

    @property
    def listen_address(self) -> str:
        """The gRPC address to bind: `listen` with `port_offset` added to its port."""
        return _offset(self.listen, self.port_offset)

    @property
    def metrics_address(self) -> str | None:
        """The metrics address to bind, `port_offset` added (None: no metrics)."""
        return _offset(self.metrics_listen, self.port_offset) if self.metrics_listen else None

    @property
    def data_address(self) -> tuple[str, int] | None:
        """Where to serve the data plane (port 0: any free one), or None for none."""
        if self.data_listen == "off":
            return None
        if self.data_listen == "auto":
            return parse_host_port(self.listen_address, "listen")[0], 0
        host, port = parse_host_port(self.data_listen, "data_listen")
        return host, port + self.port_offset if port else 0

    @property
    def token_path(self) -> str | None:
        """The token file: auth_token_file, or the credential in $CREDENTIALS_DIRECTORY."""
        if self.auth_token_credential and self.credentials_directory:
            return str(Path(self.credentials_directory) / self.auth_token_credential)
        return self.auth_token_file

    def validate(self) -> Config:
        if not self.listen:
            raise ConfigError("listen: an address HOST:PORT is required (--listen)")
        parse_host_port(self.listen, "listen")
        if self.metrics_listen:
            parse_host_port(self.metrics_listen, "metrics_listen")
        if self.data_listen not in ("auto", "off"):
            parse_host_port(self.data_listen, "data_listen")
        if self.data_loop not in DATA_LOOPS:
            raise ConfigError(f"data_loop: one of {', '.join(DATA_LOOPS)}, got "
                              f"{self.data_loop!r}")
        self._validate_port_offset()
        for name in ("round_timeout_s", "drain_grace_s", "stalled_after_s",
                     "stream_idle_timeout_s", "job_idle_expiry_s", "grpc_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_inflight_bytes", "max_message_bytes"):
            if getattr(self, name) < 1024:
                raise ConfigError(f"{name}: must be at least 1024, got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca: needs tls_cert and tls_key")
        if self.max_open_chunks_per_job < 1:
            raise ConfigError(f"max_open_chunks_per_job: must be >= 1, got "
                              f"{self.max_open_chunks_per_job}")
        if not 1 <= self.max_world_size <= WORLD_SIZE_FIELD_MAX:
            raise ConfigError(f"max_world_size: must be between 1 and {WORLD_SIZE_FIELD_MAX}, "
                              f"got {self.max_world_size}")
        if not 1 <= self.threads <= MAX_THREADS:
            raise ConfigError(f"threads: must be between 1 and {MAX_THREADS}, got "
                              f"{self.threads}")
        if self.status_max_jobs < 1:
            raise ConfigError(f"status_max_jobs: must be >= 1, got {self.status_max_jobs}")
        for name in ("max_inflight_bytes_per_job", "pool_chunk_bytes", "pool_busy_cores",
                     "metrics_max_jobs", "token_grace_s", "max_record_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        self._validate_credential()
        if self.metrics_auth_file and not self.metrics_listen:
            raise ConfigError("metrics_auth_file: needs metrics_listen")
        for name in ("auth_token_file", "tls_cert", "tls_key", "tls_client_ca",
                     "metrics_auth_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path!r}")
        self.auth_token()  # a token no client could send stops the start, not every call
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level: one of debug, info, warning, error, "
                              f"got {self.log_level!r}")
        return self

    def _validate_port_offset(self) -> None:
        if self.port_offset == 0:
            return
        if not 0 < self.port_offset < 65536:
            raise ConfigError(f"port_offset: must be between 0 and 65535, got {self.port_offset}")
        for name in ("listen", "metrics_listen", "data_listen"):
            address = getattr(self, name)
            if not address or address in ("auto", "off"):
                continue
            port = parse_host_port(address, name)[1]
            if port == 0 and name != "data_listen":
                raise ConfigError(f"port_offset: needs a fixed {name} port, not 0")
            if port + self.port_offset > 65535:
                raise ConfigError(f"port_offset: {name} port {port} + {self.port_offset} "
                                  "passes 65535")

    def _validate_credential(self) -> None:
        name = self.auth_token_credential
        if not name:
            return
        if self.auth_token_file:
            raise ConfigError("auth_token_credential and auth_token_file: give one, not both")
        if "/" in name or name in (".", ".."):
            raise ConfigError(f"auth_token_credential: a credential name, not a path: {name!r}")
        if not self.credentials_directory:
            raise ConfigError("auth_token_credential: $CREDENTIALS_DIRECTORY is not set (load "
                              f"it with LoadCredential={name}:FILE in the unit, or use "
                              "auth_token_file)")
        if not Path(self.credentials_directory, name).is_file():
            raise ConfigError(f"auth_token_credential: no credential {name!r} in "
                              f"{self.credentials_directory!r}")

    def auth_token(self) -> str | None:
        path = self.token_path
        if not path:
            return None
        try:
            return read_token_file(path)
        except TokenFileError as exc:
            option = "auth_token_credential" if self.auth_token_credential else "auth_token_file"
            raise ConfigError(f"{option}: {exc}") from None

    def to_toml(self) -> str:
        """The options as a TOML document that `--config` reads back to this Config."""
        lines = ["# reducerd effective configuration: defaults < --config file < flags"]
        if self.port_offset:
            lines.append(f"# port_offset {self.port_offset}: serving on {self.listen_address}"
                         + (f", metrics on {self.metrics_address}" if self.metrics_listen
                            else ""))
        if self.credentials_directory and self.auth_token_credential:
            lines.append(f"# token read from {self.token_path}")
        for flag, name in _FLAGS.items():
            key, value = flag[2:].replace("-", "_"), getattr(self, name)
            lines.append(f"# {key}: unset" if value is None else
                         f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _offset(address: str, offset: int) -> str:
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + offset}" if offset else address


def _toml_value(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"no TOML form for {value!r}")
    # A JSON string is a valid TOML basic string; repr(float) always has '.', 'e' or 'inf'.
    return json.dumps(value) if isinstance(value, str) else repr(value)


def parse_host_port(address: str, option: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{option}: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


# TOML keys are the flag names without dashes ("round-timeout" or "round_timeout").
_TOML_KEYS = {flag[2:].replace("-", "_"): name for flag, name in _FLAGS.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    types = {f.name: f.type for f in fields(Config)}
    for flag, name in _FLAGS.items():
        kind = types[name]
        conv = float if "float" in str(kind) else int if kind in ("int", int) else str
        parser.add_argument(flag, dest=name, type=conv, default=None,
                            metavar=name.upper().removesuffix("_S"), help=_HELP.get(name))
    parser.add_argument("--config", metavar="FILE.toml", help="TOML configuration file")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration as TOML and exit")


def _from_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path!r} is not valid TOML: {exc}") from exc
    values = {}
    types = {f.name: f.type for f in fields(Config)}
    for key, value in raw.items():
        name = _TOML_KEYS.get(key.replace("-", "_"))
        if name is None:
            raise ConfigError(f"config: unknown key {key!r} in {path!r}; known keys: "
                              f"{', '.join(sorted(_TOML_KEYS))}")
        kind = str(types[name])
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              if "float" in kind else
              isinstance(value, int) and not isinstance(value, bool) if kind == "int" else
              isinstance(value, str))
        if not ok:
            raise ConfigError(f"config: {key} in {path!r} has the wrong type "
                              f"({type(value).__name__}): expected {kind}")
        values[name] = value
    return values


def config_from_args(args: argparse.Namespace,
                     environ: Mapping[str, str] | None = None) -> Config:
    """Build and validate the Config from parsed arguments (and their --config).

    The daemon's environment is read here and nowhere else: $CREDENTIALS_DIRECTORY
    (systemd's LoadCredential=), $NOTIFY_SOCKET and $WATCHDOG_USEC / $WATCHDOG_PID
    (systemd's Type=notify and WatchdogSec=), REDUCER_WIRE_NUMPY and
    REDUCERD_DATA_LOOP.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = (_from_toml(args.config) if getattr(args, "config", None)
                              else {})
    values["credentials_directory"] = environ.get("CREDENTIALS_DIRECTORY") or None
    values["wire_numpy"] = environ.get("REDUCER_WIRE_NUMPY", "") not in ("", "0")
    values["notify_socket"] = environ.get("NOTIFY_SOCKET") or None
    values["watchdog_s"] = _watchdog_s(environ)
    if environ.get("REDUCERD_DATA_LOOP"):  # below the flag, above the file
        values["data_loop"] = environ["REDUCERD_DATA_LOOP"]
    for name in _FLAGS.values():
        flag_value = getattr(args, name, None)
        if flag_value is not None:
            values[name] = flag_value
    return dataclasses.replace(Config(), **values).validate()


def _watchdog_s(environ: Mapping[str, str]) -> float | None:
    """systemd's watchdog period, if it is meant for this process."""
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
        return int(usec) / 1e6
    return None
