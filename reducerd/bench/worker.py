"""One benchmark worker process: `python -m reducerd.bench.worker SPEC_JSON`.

Started by the runner, in the main or the MXNet virtual environment and
possibly inside a network namespace. It reports on stdout, one line per
event, each `@bench ` followed by JSON, so a framework's own prints cannot
be mistaken for results; anything else goes to the log.
"""

from __future__ import annotations

import json
import sys
import traceback

__all__ = ["main", "MARKER"]

MARKER = "@bench "


def emit(event: str, **fields) -> None:
    print(MARKER + json.dumps({"event": event, **fields}), flush=True)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    try:
        from reducerd.bench.systems import make_comm, run_sweep

        comm = make_comm(spec)
        emit("ready")
        run_sweep(comm, spec, emit)
        comm.close()
    except BaseException as exc:  # report everything, a KeyboardInterrupt included
        traceback.print_exc(file=sys.stderr)
        emit("error", message=f"{type(exc).__name__}: {exc}")
        return 1
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
