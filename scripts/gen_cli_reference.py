"""Write docs/reference/cli.md from the argument parsers' own --help.

    python scripts/gen_cli_reference.py [--check]

Each command's help is what `reducerd ... --help` prints at a fixed width, so
the page cannot drift from the parsers: tests/docs/test_cli_reference.py
compares the page in the tree with what this script makes.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "cli.md"
COMMANDS = [
    ("reducerd", [], "The daemon."),
    ("reducerd status", ["status"], "Jobs, open rounds and throughput of a running daemon."),
    ("reducerd top", ["top"], "The same, refreshed live."),
    ("reducerd token", ["token"], "A job's token, derived from the daemon token."),
    ("reducerd plan", ["plan"], "The capacity planner."),
    ("reducerd bench", ["bench"], "The benchmark: real daemons and worker processes."),
]
WIDTH = "100"


def help_text(argv: list[str]) -> str:
    """What `reducerd ARGV --help` prints, at WIDTH columns."""
    from reducerd.__main__ import main

    os.environ["COLUMNS"] = WIDTH
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue().rstrip() + "\n"


def render() -> str:
    parts = ["# Command line", "",
             "Generated from the argument parsers by `scripts/gen_cli_reference.py`",
             "(`make docs-cli`); do not edit by hand. Every daemon flag is also a TOML key",
             "(the flag without its leading dashes, dashes or underscores).", ""]
    for title, argv, summary in COMMANDS:
        parts += [f"## `{title}`", "", summary, "", "```text", help_text(argv).rstrip(), "```", ""]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--check"]:
        if PAGE.read_text() != text:
            print(f"{PAGE} is stale: run scripts/gen_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
