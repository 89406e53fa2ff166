"""Job ids and keys in log lines and error messages: quoted, escaped, cut short.

Names are the clients' (up to the codec's MAX_NAME_CHARS each, 1,000
characters): every line and message that names a job or key goes through
`short_name`, so neither grows with them.
"""

from __future__ import annotations

__all__ = ["NAME_LOG_CHARS", "short_name"]

NAME_LOG_CHARS = 64  # a job id or key in a log line or error message, at most


def short_name(name: str) -> str:
    """`name` as repr() quotes it (control characters escaped: no forged lines),
    cut to NAME_LOG_CHARS characters with its length said."""
    if len(name) <= NAME_LOG_CHARS:
        return repr(name)
    return f"{name[:NAME_LOG_CHARS]!r}... ({len(name)} characters)"
