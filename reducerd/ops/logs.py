"""The daemon's log lines on stderr, at their level in the journal under systemd.

journald records every line a service writes to stderr at the unit's default
priority (info) unless the line starts with an sd-daemon level prefix, "<4>"
for a warning, "<3>" for an error (sd-daemon(3); SyslogLevelPrefix=yes, the
default). systemd sets $JOURNAL_STREAM to "DEVICE:INODE" of the stream it
connected to stderr, so the daemon prefixes its lines exactly when stderr is
that stream (not when a child merely inherited the variable), and then leaves
out the timestamp, which journald adds itself. Elsewhere (a terminal, a
container's log) the lines are unchanged: timestamp, level, logger, message.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

__all__ = ["JournalFormatter", "log_error", "setup_logging", "stderr_is_journal",
           "syslog_priority"]

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"
# syslog priorities (RFC 5424), highest logging level first.
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
               (logging.INFO, 6))
_DEBUG_PRIORITY = 7


def syslog_priority(level: int) -> int:
    """The syslog priority of a logging level: 3 for ERROR, 4 for WARNING, 7 below INFO."""
    return next((priority for floor, priority in _PRIORITIES if level >= floor),
                _DEBUG_PRIORITY)


def stderr_is_journal(environ: Mapping[str, str] | None = None,
                      stream: TextIO | None = None) -> bool:
    """True if `stream` (stderr) is the journal stream that $JOURNAL_STREAM names."""
    environ = os.environ if environ is None else environ
    device, _, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        stat = os.fstat((sys.stderr if stream is None else stream).fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test's capture)
        return False
    return (stat.st_dev, stat.st_ino) == (int(device), int(inode))


class JournalFormatter(logging.Formatter):
    """Prefixes every line of a record with its priority, tracebacks included:
    journald splits a record into entries at newlines."""

    def __init__(self) -> None:
        super().__init__(JOURNAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def setup_logging(level: str, environ: Mapping[str, str] | None = None,
                  stream: TextIO | None = None) -> None:
    """Log at `level` ("info", "warning", ...) to stderr, journal-aware."""
    stream = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter() if stderr_is_journal(environ, stream)
                         else logging.Formatter(PLAIN_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def log_error(message: str, environ: Mapping[str, str] | None = None,
              stream: TextIO | None = None) -> None:
    """Write one error line to stderr before logging is set up (a configuration error)."""
    stream = sys.stderr if stream is None else stream
    prefix = f"<{syslog_priority(logging.ERROR)}>" if stderr_is_journal(environ, stream) else ""
    stream.write("".join(f"{prefix}{line}\n" for line in message.split("\n")))
    stream.flush()
