"""The daemon's log lines on stderr, at their level in the journal under systemd;
names cut short and refusals rate-limited in them.

journald records every line a service writes to stderr at the unit's default
priority (info) unless the line starts with an sd-daemon level prefix, "<4>"
for a warning, "<3>" for an error (sd-daemon(3); SyslogLevelPrefix=yes, the
default). systemd sets $JOURNAL_STREAM to "DEVICE:INODE" of the stream it
connected to stderr, so the daemon prefixes its lines exactly when stderr is
that stream (not when a child merely inherited the variable), and then leaves
out the timestamp, which journald adds itself. Elsewhere (a terminal, a
container's log) the lines are unchanged: timestamp, level, logger, message.

Job ids and keys are the clients' (up to the codec's MAX_NAME_CHARS each), and
a refusal can come at the rate a client sends: every line names a job or key
through `short_name`, and refusals go through a `RepeatLimiter`, so the log
grows with the kinds of trouble, not with how often a tenant repeats it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import TextIO

from reducerd.core.names import NAME_LOG_CHARS, short_name

__all__ = ["JournalFormatter", "RepeatLimiter", "log_error", "setup_logging", "short_name",
           "stderr_is_journal", "syslog_priority", "NAME_LOG_CHARS", "LOG_LINE_CHARS"]

LOG_LINE_CHARS = 1024  # a rate-limited message, at most (its names cut already)
REPEAT_PERIOD_S = 10.0
REPEAT_KINDS = 1024  # kinds whose repeats are counted; the oldest is summed up first
REPEAT_LINES = 200  # first lines of new kinds per period, at most; beyond, counted

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


class RepeatLimiter:
    """Log the first message of each kind at once, then count its repeats for
    `period_s` and say how many there were ("N more like this in the last T s").

    A kind is what the caller says is the same trouble, e.g. (job, status
    code). At most `max_kinds` kinds are remembered (the oldest is summed up
    and forgotten first) and at most `max_lines` first lines of new kinds are
    written per period (the rest are summed up in one line), so a tenant that
    invents a new job or key for every refusal still writes a bounded log.
    The loop thread alone calls it (no lock); `flush` on its timer.
    """

    def __init__(self, logger: logging.Logger, period_s: float = REPEAT_PERIOD_S,
                 max_kinds: int = REPEAT_KINDS, max_lines: int = REPEAT_LINES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.period_s, self._clock = logger, period_s, clock
        self._max_kinds, self._max_lines = max_kinds, max_lines
        # kind -> [window start, repeats since, level, what the first line said]
        self._kinds: OrderedDict[Hashable, list] = OrderedDict()
        self._window_s, self._lines, self._unwritten = clock(), 0, 0

    def log(self, level: int, kind: Hashable, message: str) -> None:
        now = self._clock()
        self._roll(now)
        entry = self._kinds.get(kind)
        if entry is not None and now - entry[0] < self.period_s:
            entry[1] += 1
            return
        if entry is not None:
            self._summarize(kind, entry, now)
        if self._lines >= self._max_lines:
            self._unwritten += 1
            return
        self._lines += 1
        self._log.log(level, "%s", _cut(message))
        self._kinds[kind] = [now, 0, level, _cut(message, 160)]
        self._kinds.move_to_end(kind)
        while len(self._kinds) > self._max_kinds:
            old_kind, old = self._kinds.popitem(last=False)
            self._summarize(old_kind, old, now)

    def flush(self) -> None:
        """Sum up the kinds whose period ended (call it now and then)."""
        now = self._clock()
        self._roll(now)
        for kind in [k for k, e in self._kinds.items() if now - e[0] >= self.period_s]:
            self._summarize(kind, self._kinds.pop(kind), now)

    def _roll(self, now: float) -> None:
        if now - self._window_s < self.period_s:
            return
        if self._unwritten:
            self._log.warning("%d more refusals of other kinds in the last %.0f s (the "
                              "first %d were logged)", self._unwritten, now - self._window_s,
                              self._max_lines)
        self._window_s, self._lines, self._unwritten = now, 0, 0

    def _summarize(self, kind: Hashable, entry: list, now: float) -> None:
        started_s, repeats, level, first = entry
        if repeats:
            self._log.log(level, "%d more like this in the last %.0f s: %s", repeats,
                          now - started_s, first)


def _cut(message: str, limit: int = LOG_LINE_CHARS) -> str:
    return message if len(message) <= limit else f"{message[:limit]}... (cut)"
