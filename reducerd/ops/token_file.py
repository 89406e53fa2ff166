"""The daemon token's file: one line of visible ASCII, checked once at the start.

Read by the configuration (the daemon refuses to start on a file no client
could send, exit code 2) and by `reducerd token`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TokenFileError", "read_token_file"]


class TokenFileError(ValueError):
    """A token file that no client could send: the message names the problem."""


def read_token_file(path: str) -> str:
    """The token in `path`: one line of visible ASCII (0x21-0x7e), surrounding
    blanks and the line end (LF or CRLF) ignored.

    Anything else is refused, because gRPC metadata carries printable ASCII
    alone: a daemon started with it would report SERVING and then fail every
    call ("Invalid metadata" in the client).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise TokenFileError(f"cannot read {path!r}: {exc.strerror}") from None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as exc:
        raise TokenFileError(f"{path!r} holds a non-ASCII byte (0x{raw[exc.start]:02x} at "
                             f"byte {exc.start}): a token is visible ASCII") from None
    token = text.strip(" \t\r\n")
    if not token:
        raise TokenFileError(f"{path!r} is empty" if not raw else
                             f"{path!r} holds only blanks and line ends, no token")
    lines = token.splitlines()
    if len(lines) > 1:
        raise TokenFileError(f"{path!r} holds {len(lines)} lines: a token is one line")
    bad = next((i for i, c in enumerate(token) if not "!" <= c <= "~"), None)
    if bad is not None:
        raise TokenFileError(f"{path!r} holds {token[bad]!r} at character {bad} of the "
                             "token: a token is visible ASCII, no blanks or control "
                             "characters inside")
    return token
