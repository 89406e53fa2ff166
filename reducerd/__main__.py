"""Command line: `reducerd --listen HOST:PORT ...`, `reducerd status`, `reducerd bench`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import NoReturn

from reducerd import __version__
from reducerd.ops.config import ConfigError, add_arguments, config_from_args
from reducerd.ops.logs import log_error, setup_logging

__all__ = ["main"]

USAGE = """reducerd [--listen HOST:PORT] [options]    run the daemon (default 127.0.0.1:7070)
       reducerd --config FILE.toml --print-config  show the effective configuration
       reducerd status --address HOST:PORT        jobs, open rounds, throughput
       reducerd top --address HOST:PORT           the same, refreshed live
       reducerd token --job JOB --auth-token-file F  print JOB's token (its shards alone)
       reducerd plan --model M --workers N --link RATE  project a cluster's traffic"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """argparse's exit 2 on a bad flag, its message at error level in the journal."""
        self.print_usage(sys.stderr)
        log_error(f"{self.prog}: error: {message}")
        sys.exit(2)


def _daemon_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="reducerd", usage=USAGE,
                     description="Sum gradient shards from data-parallel "
                                 "workers (reducer.v1.Reducer over gRPC).")
    add_arguments(parser)
    parser.add_argument("--version", action="version", version=f"reducerd {__version__}")
    return parser


def _run_daemon(argv: list[str]) -> int:
    args = _daemon_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        log_error(f"reducerd: {exc}")  # at error level in the journal
        return 2
    if args.print_config:
        sys.stdout.write(config.to_toml())
        return 0
    setup_logging(config.log_level)
    from reducerd.daemon.server import Daemon  # grpc import only when serving
    from reducerd.ops.memory import tune_malloc

    tune_malloc()

    logging.getLogger("reducerd").info(
        "reducerd %s starting (round timeout %g s, max inflight %d bytes)", __version__,
        config.round_timeout_s, config.max_inflight_bytes)
    try:
        # The service manager's socket and watchdog come from the Config (it read them).
        asyncio.run(Daemon(config, reload_config=lambda: config_from_args(args)).serve())
    except ConfigError as exc:  # the token file changed between the check and the start
        log_error(f"reducerd: {exc}")
        return 2
    except RuntimeError as exc:  # e.g. the port is taken
        logging.getLogger("reducerd").error("cannot serve: %s", exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":
        from reducerd.daemon.status import main as status_main

        return status_main(argv[1:])
    if argv and argv[0] == "top":
        from reducerd.daemon.status import top_main

        return top_main(argv[1:])
    if argv and argv[0] == "token":
        from reducerd.service.access import main as token_main

        return token_main(argv[1:])
    if argv and argv[0] == "bench":
        from reducerd.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "plan":
        from reducerd.plan import main as plan_main

        return plan_main(argv[1:])
    return _run_daemon(argv)


if __name__ == "__main__":
    sys.exit(main())
