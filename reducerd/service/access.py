"""Who may do what: the daemon token (every job, all status) and job tokens (one job).

A job's token is derived from the daemon token, so daemons need no per-job
configuration (`reducerd token --job JOB --auth-token-file F` prints it):

    rj1.<JOB as base64url, no padding>.<HMAC-SHA256(key=daemon token, msg=JOB), hex>

(the token and the job as UTF-8). The MAC is what makes it a token; the job
rides in front of it so that a daemon can check a token with nothing else to
go on (the brief status, the data plane's HELLO). An operator without
reducerd at hand computes the same with
`printf %s "$JOB" | openssl dgst -sha256 -hmac "$(cat token)"`.

A job token authorizes shards of its job, GetStatus of its job and the brief
status, nothing else (PERMISSION_DENIED). Every comparison is constant-time.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import hmac
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from reducerd.core.names import short_name
from reducerd.ops.token_file import TokenFileError, read_token_file

__all__ = ["JOB_TOKEN_PREFIX", "Grant", "EVERY_JOB", "Access", "job_token",
           "token_job", "bearer_token", "main"]

JOB_TOKEN_PREFIX = "rj1."


@dataclass(frozen=True)
class Grant:
    """What a caller may touch: every job (job None) or one job."""

    job: str | None = None

    def allows(self, job: str) -> bool:
        return self.job is None or self.job == job

    def refusal(self, job: str) -> str:
        """The PERMISSION_DENIED message for touching `job` with this grant."""
        return (f"the token is job {short_name(self.job or '')}'s and authorizes that job "
                f"alone, not job {short_name(job)} (reducerd token --job JOB gives that "
                "job's token)")


EVERY_JOB = Grant()


def _mac(daemon_token: str, job: str) -> str:
    return hmac.new(daemon_token.encode(), job.encode(), hashlib.sha256).hexdigest()


def job_token(daemon_token: str, job: str) -> str:
    """JOB's token under `daemon_token` (see the module docstring for the form)."""
    if not job:
        raise ValueError("job: must be a non-empty string")
    name = base64.urlsafe_b64encode(job.encode()).rstrip(b"=").decode()
    return f"{JOB_TOKEN_PREFIX}{name}.{_mac(daemon_token, job)}"


def token_job(token: str) -> str | None:
    """The job a job-token-shaped string names (not checked), or None."""
    if not token.startswith(JOB_TOKEN_PREFIX):
        return None
    name, sep, _ = token[len(JOB_TOKEN_PREFIX):].partition(".")
    try:
        job = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return job if sep and job else None


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            if text.startswith("Bearer "):
                return text[len("Bearer "):]
    return None


class Access:
    """The daemon's token check. Without a token every caller may do everything.

    `rotate` replaces the token (SIGHUP): the previous one, and the job tokens
    derived from it, are still honoured for a grace period, so workers can be
    handed the new one while the old one still serves their rounds. Only new
    calls and connections are checked; those open carry on.
    """

    def __init__(self, daemon_token: str | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._token = daemon_token
        self._clock = clock
        # The tokens replaced by rotate() and until when (clock) each is honoured;
        # the loop thread alone reads and writes it.
        self._previous: list[tuple[str, float]] = []

    @property
    def required(self) -> bool:
        return self._token is not None

    @property
    def token(self) -> str | None:
        return self._token

    def rotate(self, daemon_token: str, grace_s: float) -> None:
        """Serve `daemon_token` from now on, the one it replaces for `grace_s` more."""
        if self._token is None:
            raise ValueError("a daemon started without a token cannot rotate to one")
        now = self._clock()
        kept = [(t, until) for t, until in self._previous if until > now and t != daemon_token]
        if self._token != daemon_token and grace_s > 0:
            kept.append((self._token, now + grace_s))
        self._previous, self._token = kept, daemon_token

    def grant(self, token: str | bytes | None) -> Grant | None:
        """What `token` authorizes, or None when it is missing or wrong."""
        if self._token is None:
            return EVERY_JOB
        if token is None:
            return None
        if isinstance(token, bytes):
            try:
                token = token.decode()
            except UnicodeDecodeError:
                return None
        grant = _grant(self._token, token)
        if grant is None and self._previous:
            now = self._clock()
            grant = next((g for t, until in self._previous
                          if until > now and (g := _grant(t, token)) is not None), None)
        return grant

    def grant_for_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None,
                           ) -> Grant | None:
        return self.grant(bearer_token(metadata)) if self._token is not None else EVERY_JOB


def _grant(daemon_token: str, token: str) -> Grant | None:
    if hmac.compare_digest(token.encode(), daemon_token.encode()):
        return EVERY_JOB
    job = token_job(token)
    if job is not None and hmac.compare_digest(token.encode(),
                                               job_token(daemon_token, job).encode()):
        return Grant(job)
    return None


def main(argv: list[str] | None = None) -> int:
    """`reducerd token --job JOB --auth-token-file F`: print JOB's token."""
    parser = argparse.ArgumentParser(
        prog="reducerd token",
        description="Print a job's token, derived from the daemon token: it authorizes "
                    "that job's shards and status alone. Hand it to the job's workers "
                    "(REDUCER_TOKEN) instead of the daemon token.")
    parser.add_argument("--job", required=True, help="the job id the workers use")
    parser.add_argument("--auth-token-file", required=True, metavar="FILE",
                        help="the daemon token (the daemons' --auth-token-file)")
    args = parser.parse_args(argv)
    try:
        daemon_token = read_token_file(args.auth_token_file)
    except TokenFileError as exc:
        print(f"reducerd token: --auth-token-file: {exc}", file=sys.stderr)
        return 2
    if not args.job:
        print("reducerd token: --job: must be a non-empty string", file=sys.stderr)
        return 2
    print(job_token(daemon_token, args.job))
    return 0
