"""The daemon's one typed configuration: defaults, TOML file, command line.

Precedence: command-line flag > TOML file (--config) > default. Everything is
checked once, here, with errors that name the offending option.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import tomllib

__all__ = ["Config", "ConfigError", "add_arguments", "config_from_args", "parse_host_port"]

GiB = 1 << 30
MiB = 1 << 20


class ConfigError(ValueError):
    """An option is missing, unknown or out of range; the message names it."""


@dataclass(frozen=True)
class Config:
    listen: str = ""
    metrics_listen: str | None = None
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

    def validate(self) -> Config:
        if not self.listen:
            raise ConfigError("listen: an address HOST:PORT is required (--listen)")
        parse_host_port(self.listen, "listen")
        if self.metrics_listen:
            parse_host_port(self.metrics_listen, "metrics_listen")
        for name in ("round_timeout_s", "drain_grace_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_inflight_bytes", "max_message_bytes"):
            if getattr(self, name) < 1024:
                raise ConfigError(f"{name}: must be at least 1024, got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca: needs tls_cert and tls_key")
        for name in ("auth_token_file", "tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path!r}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level: one of debug, info, warning, error, "
                              f"got {self.log_level!r}")
        return self

    def auth_token(self) -> str | None:
        if not self.auth_token_file:
            return None
        token = Path(self.auth_token_file).read_text().strip()
        if not token:
            raise ConfigError(f"auth_token_file: {self.auth_token_file!r} is empty")
        return token


def parse_host_port(address: str, option: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{option}: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


# Command-line flag -> Config field.
_FLAGS = {
    "--listen": "listen",
    "--metrics-listen": "metrics_listen",
    "--auth-token-file": "auth_token_file",
    "--tls-cert": "tls_cert",
    "--tls-key": "tls_key",
    "--tls-client-ca": "tls_client_ca",
    "--round-timeout": "round_timeout_s",
    "--max-inflight-bytes": "max_inflight_bytes",
    "--max-message-bytes": "max_message_bytes",
    "--drain-grace": "drain_grace_s",
    "--log-level": "log_level",
}
# TOML keys are the flag names without dashes ("round-timeout" or "round_timeout").
_TOML_KEYS = {flag[2:].replace("-", "_"): name for flag, name in _FLAGS.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    types = {f.name: f.type for f in fields(Config)}
    for flag, name in _FLAGS.items():
        kind = types[name]
        conv = float if "float" in str(kind) else int if kind in ("int", int) else str
        parser.add_argument(flag, dest=name, type=conv, default=None,
                            metavar=name.upper().removesuffix("_S"))
    parser.add_argument("--config", metavar="FILE.toml", help="TOML configuration file")


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


def config_from_args(args: argparse.Namespace) -> Config:
    """Build and validate the Config from parsed arguments (and their --config)."""
    values = _from_toml(args.config) if getattr(args, "config", None) else {}
    for name in _FLAGS.values():
        flag_value = getattr(args, name, None)
        if flag_value is not None:
            values[name] = flag_value
    return dataclasses.replace(Config(), **values).validate()
