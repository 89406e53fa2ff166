"""SIGHUP: read the configuration and the token file again, apply what may change.

The token rotates (the previous one, and its job tokens, still authorize
for token_grace_s); the settings in config.RELOADABLE take effect at once;
every other change is named in the log as applied at a restart only. Open
rounds and streams carry on: nothing here touches them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from reducerd.ops.config import RELOADABLE, Config, ConfigError

__all__ = ["reload_daemon"]

log = logging.getLogger("reducerd")

# Config fields read from the environment at the start, not options.
_FROM_THE_ENVIRONMENT = ("credentials_directory", "notify_socket", "watchdog_s", "wire_numpy")


def reload_daemon(daemon: Any, read_config: Callable[[], Config]) -> list[str]:
    """SIGHUP: read the configuration and the token file again and apply
    what may change while serving; log each change, and what would need a
    restart. A configuration that does not validate changes nothing.
    `daemon`: the serving reducerd.daemon.server.Daemon (not imported: it
    imports this). Returns the changes (for tests)."""
    old = daemon.config
    try:
        new = read_config()
        token = new.auth_token()
    except ConfigError as exc:
        log.error("SIGHUP: nothing reloaded, the configuration in use stays: %s", exc)
        return []
    changes = []
    if token != daemon.access.token:
        if token is None or daemon.access.token is None:
            log.warning("SIGHUP: turning the token %s needs a restart; the token in "
                        "use stays", "off" if token is None else "on")
        else:
            daemon.access.rotate(token, new.token_grace_s)
            changes.append(f"token rotated (the previous one authorizes for "
                           f"{new.token_grace_s:g} s more)")
    updates = {name: getattr(new, name) for name in RELOADABLE
               if getattr(new, name) != getattr(old, name)}
    changes += [f"{name} {getattr(old, name)!r} -> {value!r}"
                for name, value in updates.items()]
    daemon.config = dataclasses.replace(old, **updates)
    _apply(daemon)
    fixed = [f.name for f in dataclasses.fields(Config)
             if f.name not in RELOADABLE and f.name not in _FROM_THE_ENVIRONMENT
             and getattr(new, f.name) != getattr(old, f.name)]
    log.info("SIGHUP: %s", "; ".join(changes) if changes else "nothing changed")
    if fixed:
        log.warning("SIGHUP: changed but applied at a restart only: %s", ", ".join(fixed))
    return changes


def _apply(daemon: Any) -> None:
    cfg = daemon.config
    logging.getLogger().setLevel(cfg.log_level.upper())
    daemon.servicer.stalled_after_s = cfg.stalled_after_s
    daemon.servicer.status_max_jobs = cfg.status_max_jobs
    daemon.table.jobs.forget_after_s = max(cfg.job_idle_expiry_s, cfg.round_timeout_s)
    if daemon.metrics is not None:
        daemon.metrics.stalled_after_s = cfg.stalled_after_s
