"""Command line: `reducerd --listen HOST:PORT ...`, `reducerd status`, `reducerd bench`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from reducerd import __version__
from reducerd.config import ConfigError, add_arguments, config_from_args

__all__ = ["main"]

USAGE = """reducerd --listen HOST:PORT [options]      run the daemon
       reducerd --config FILE.toml --print-config  show the effective configuration
       reducerd status --address HOST:PORT        jobs, open rounds, throughput
       reducerd top --address HOST:PORT           the same, refreshed live"""


def _daemon_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reducerd", usage=USAGE,
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
        print(f"reducerd: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(config.to_toml())
        return 0
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from reducerd.memory import tune_malloc
    from reducerd.notify import Notifier
    from reducerd.server import Daemon  # grpc import only when serving

    tune_malloc()

    logging.getLogger("reducerd").info(
        "reducerd %s starting (round timeout %g s, max inflight %d bytes)", __version__,
        config.round_timeout_s, config.max_inflight_bytes)
    try:
        # The service manager's protocol lives in the environment; read it here, once.
        asyncio.run(Daemon(config, notifier=Notifier.from_environ()).serve())
    except RuntimeError as exc:  # e.g. the port is taken
        logging.getLogger("reducerd").error("cannot serve: %s", exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":
        from reducerd.status import main as status_main

        return status_main(argv[1:])
    if argv and argv[0] == "top":
        from reducerd.status import top_main

        return top_main(argv[1:])
    if argv and argv[0] == "bench":
        from reducerd.bench import main as bench_main

        return bench_main(argv[1:])
    return _run_daemon(argv)


if __name__ == "__main__":
    sys.exit(main())
