"""`reducerd bench`: reducerd against Gloo's ring and MXNet's parameter server.

Import-light on purpose: `reducerd bench --help` parses arguments only; the
frameworks are imported by the worker processes that need them.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Run `reducerd bench ARGV`; return the process exit status."""
    from reducerd.bench.cli import main as cli_main

    return cli_main(argv)
