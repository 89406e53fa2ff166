"""`reducerd status` and `reducerd top`: a daemon's jobs, open and stalled rounds, throughput.

    reducerd status --address HOST:PORT [--json] [--job JOB] [--jobs N]
    reducerd top --address HOST:PORT [--interval S] [--iterations N]

Both call reducer.v1.Reducer/GetStatus. Throughput is the daemon's own sliding
window over its byte counters; a window needs two calls, so `status` makes
one, waits `--sample` seconds and renders the second (`top` keeps calling).
The daemon lists its most recently active jobs (its --status-max-jobs, or
`--jobs N`) and counts the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from reducer_wire.tls import TLS_REFUSAL, channel_credentials, diagnose_handshake
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from reducerd.service.access import token_job

__all__ = ["main", "top_main", "fetch_status", "reply_to_dict", "render"]


class StatusError(RuntimeError):
    """The daemon could not be asked; the message says why and what to try."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def _parser(prog: str, live: bool) -> argparse.ArgumentParser:
    what = "refreshed live until Ctrl-C" if live else "once"
    parser = argparse.ArgumentParser(
        prog=prog, description=f"Show a reducerd daemon's jobs, open and stalled rounds and "
                               f"throughput, {what}.")
    parser.add_argument("--address", required=True, metavar="HOST:PORT")
    parser.add_argument("--job", default="", help="only this job (default with a job "
                                                  "token: its job)")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", help="bearer token of an authenticated daemon: the "
                                       "daemon token, or a job token (reducerd token)")
    token.add_argument("--token-file", metavar="FILE", help="read the token from FILE")
    parser.add_argument("--tls-ca", metavar="FILE", help="CA bundle: connect with TLS")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", metavar="FILE", help="client key (mutual TLS)")
    parser.add_argument("--jobs", type=int, default=0, metavar="N",
                        help="list up to N jobs, the most recently active (default: the "
                             "daemon's --status-max-jobs; the daemon keeps the reply "
                             "under 2 MiB of jobs whatever N)")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                        help="deadline of one status call (default 5)")
    if live:
        parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                            help="seconds between refreshes (default 1)")
        parser.add_argument("--iterations", type=int, default=0, metavar="N",
                            help="stop after N refreshes (default: until Ctrl-C)")
    else:
        parser.add_argument("--json", action="store_true", help="print JSON, not a table")
        parser.add_argument("--sample", type=float, default=1.0, metavar="SECONDS",
                            help="seconds between the two calls that measure throughput "
                                 "(default 1; 0: one call, throughput may read 0)")
    return parser


class _Client:
    """One channel to one daemon, with the token and TLS the arguments give."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.address = args.address
        self.timeout_s = args.timeout
        self.max_jobs = max(0, args.jobs)
        token = args.token
        if args.token_file:
            token = Path(args.token_file).read_text().strip()
        # A job token reads its own job's status alone: that job unless told otherwise.
        self.job = args.job or (token_job(token) if token else None) or ""
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls: tuple[str | None, str | None, str | None] | None = None
        if args.tls_ca or args.tls_cert or args.tls_key:
            self.tls = (args.tls_ca, args.tls_cert, args.tls_key)
            credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key,
                                              option="--tls-ca/--tls-cert/--tls-key")
            self.channel = grpc.secure_channel(self.address, credentials)
        else:
            self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.ReducerStub(self.channel)

    def fetch(self) -> pb.StatusReply:
        try:
            return fetch_status(self.stub, self.address, self.metadata, self.timeout_s,
                                self.job, self.max_jobs)
        except StatusError as exc:
            # gRPC says "Socket closed" for a refused client certificate: one
            # handshake of our own names the TLS reason, if that is it.
            reason = (diagnose_handshake(self.address, *self.tls)
                      if self.tls and exc.code == grpc.StatusCode.UNAVAILABLE else None)
            if reason:
                raise StatusError(f"cannot get the status of {self.address}: UNAVAILABLE: "
                                  f"{TLS_REFUSAL}: {reason}", exc.code) from exc
            raise

    def close(self) -> None:
        self.channel.close()


def fetch_status(stub: Any, address: str, metadata: tuple[tuple[str, str], ...] = (),
                 timeout_s: float = 5.0, job: str = "", max_jobs: int = 0) -> pb.StatusReply:
    """Call GetStatus; translate a failure into a StatusError that says what to do."""
    try:
        return stub.GetStatus(pb.StatusRequest(job=job, max_jobs=max_jobs),
                              timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        hint = {
            grpc.StatusCode.UNAUTHENTICATED: " (the daemon wants a token: --token-file FILE)",
            grpc.StatusCode.UNAVAILABLE: " (is the daemon running, and is this its address?)",
            grpc.StatusCode.PERMISSION_DENIED: " (a job token reads its own job alone: "
                                               "--job JOB)",
        }.get(code, "")  # type: ignore[call-overload]
        details = exc.details() if hasattr(exc, "details") else str(exc)
        name = code.name if code is not None else "ERROR"
        raise StatusError(f"cannot get the status of {address}: {name}: {details}{hint}",
                          code) from exc


def reply_to_dict(reply: pb.StatusReply, address: str = "") -> dict[str, Any]:
    """The reply as plain JSON types (integers stay integers, unlike proto JSON)."""
    return {
        "address": address, "version": reply.version, "uptime_s": reply.uptime_s,
        "bytes_held": reply.bytes_held, "max_inflight_bytes": reply.max_inflight_bytes,
        "open_streams": reply.open_streams, "stalled_after_s": reply.stalled_after_s,
        "round_timeout_s": reply.round_timeout_s, "data_port": reply.data_port,
        "jobs_total": reply.jobs_total, "jobs_open": reply.jobs_open,
        "record_bytes": reply.record_bytes, "max_record_bytes": reply.max_record_bytes,
        "jobs": [{"job": j.job, "world_sizes": list(j.world_sizes),
                  "open_chunks": j.open_chunks, "open_chunk_bytes": j.open_chunk_bytes,
                  "chunks_completed": j.chunks_completed,
                  "chunks_failed": j.chunks_failed, "bytes_in": j.bytes_in,
                  "bytes_out": j.bytes_out, "bytes_in_per_s": j.bytes_in_per_s,
                  "bytes_out_per_s": j.bytes_out_per_s,
                  "first_seen_unix_s": j.first_seen_unix_s} for j in reply.jobs],
        "stalled": [{"job": c.job, "key": c.key, "round": c.round, "offset": c.offset,
                     "world_size": c.world_size, "missing_ranks": list(c.missing_ranks),
                     "age_s": c.age_s} for c in reply.stalled],
    }


def render(reply: pb.StatusReply, address: str) -> Group:
    """A header line, the jobs table and the stalled-rounds table."""
    header = Text.assemble(
        (f"reducerd {reply.version}", "bold"), f" at {address}  ·  up {_duration(reply.uptime_s)}"
        f"  ·  {reply.open_streams} stream(s)  ·  held {_bytes(reply.bytes_held)} of "
        f"{_bytes(reply.max_inflight_bytes)}  ·  round timeout {reply.round_timeout_s:g} s"
        f"  ·  data port {reply.data_port or 'off'}")
    title = "Jobs"
    if reply.jobs_total > len(reply.jobs):
        title = (f"Jobs: the {len(reply.jobs)} most recently active of {reply.jobs_total} "
                 f"({reply.jobs_open} with open chunks; --jobs N lists more)")
    jobs = Table(title=title, title_justify="left", expand=False)
    for name, justify in (("job", "left"), ("world", "right"), ("open chunks", "right"),
                          ("held", "right"), ("completed", "right"), ("failed", "right"),
                          ("in", "right"),
                          ("out", "right"), ("in/s", "right"), ("out/s", "right")):
        jobs.add_column(name, justify=justify)  # type: ignore[arg-type]
    for j in reply.jobs:
        jobs.add_row(_name(j.job), ",".join(map(str, j.world_sizes)), str(j.open_chunks),
                     _bytes(j.open_chunk_bytes), str(j.chunks_completed),
                     Text(str(j.chunks_failed), style="red" if j.chunks_failed else ""),
                     _bytes(j.bytes_in), _bytes(j.bytes_out), _bytes(j.bytes_in_per_s) + "/s",
                     _bytes(j.bytes_out_per_s) + "/s")
    if not reply.jobs:
        jobs.add_row(Text("no jobs yet", style="dim"), *[""] * 9)
    stalled = Table(title=f"Stalled rounds (open longer than {reply.stalled_after_s:g} s)",
                    title_justify="left")
    for name, justify in (("job", "left"), ("key", "left"), ("round", "right"),
                          ("offset", "right"), ("age", "right"), ("missing ranks", "left")):
        stalled.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in reply.stalled:
        stalled.add_row(_name(c.job), _name(c.key), str(c.round), str(c.offset), f"{c.age_s:.1f} s",
                        Text(f"{_ranges(c.missing_ranks)} of {c.world_size}", style="yellow"))
    if not reply.stalled:
        stalled.add_row(Text("none", style="dim"), *[""] * 5)
    return Group(header, jobs, stalled)


def _console() -> Console:
    # Not a terminal (a pipe, a log): wide enough that no column is cut.
    return Console(width=None if sys.stdout.isatty() else 160)


def _open(prog: str, argv: list[str] | None, live: bool,
          ) -> tuple[argparse.Namespace, _Client] | None:
    """Parse the command line and connect; None (after saying why) if a file is
    unreadable or the TLS files do not go together."""
    args = _parser(prog, live=live).parse_args(argv)
    try:
        return args, _Client(args)
    except (OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """`reducerd status`: print the status once, as a table or JSON."""
    opened = _open("reducerd status", argv, live=False)
    if opened is None:
        return 2
    args, client = opened
    try:
        reply = client.fetch()
        if args.sample > 0:
            time.sleep(args.sample)
            reply = client.fetch()
    except StatusError as exc:
        print(f"reducerd status: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(reply_to_dict(reply, args.address), indent=2))
    else:
        _console().print(render(reply, args.address))
    return 0


def top_main(argv: list[str] | None = None) -> int:
    """`reducerd top`: the status, refreshed every --interval until Ctrl-C."""
    opened = _open("reducerd top", argv, live=True)
    if opened is None:
        return 2
    args, client = opened
    count = 0
    try:
        with Live(Text("connecting to " + args.address), console=_console(),
                  auto_refresh=False, transient=False) as live:
            while True:
                try:
                    view: Any = render(client.fetch(), args.address)
                except StatusError as exc:  # keep trying: the daemon may be restarting
                    view = Text(f"{exc}\n(retrying every {args.interval:g} s)", style="red")
                live.update(view, refresh=True)
                count += 1
                if args.iterations and count >= args.iterations:
                    break
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return 0


def _name(name: str, limit: int = 64) -> str:
    """A job or key cut for a table cell (the JSON keeps it whole)."""
    return name if len(name) <= limit else f"{name[:limit - 3]}..."


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _ranges(ranks: Any) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    values = sorted(ranks)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(parts)
