"""Run every test function of the vendored Horovod files on 2 ranks, 2 daemons.

    python tests/horovod_suite/survey.py [test_torch test_tensorflow test_tensorflow2_keras]
        [--out DIR]
    python tests/horovod_suite/survey.py test_torch:test_horovod_join_allreduce,test_...

Runs each named module as test_horovod_suites.py does (2 processes, 2 real
daemons on 127.0.0.1, the client's REDUCER_TIMEOUT at the runner's
CASE_TIMEOUT_S) and prints one line a function: its outcome on each rank
and the first line of the failure. The per-rank JSON lines land in DIR
(default a temporary directory) as they come.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "helpers"))

from suite_runner import run_cases  # noqa: E402
from support import run_workers, running_daemons  # noqa: E402

# Above the runner's gate timeout: a rank may reach a case that much later.
ROUND_TIMEOUT_S = 60
MODULES = ["test_torch", "test_tensorflow", "test_tensorflow2_keras"]


def _summary(detail: str) -> str:
    lines = [line.strip() for line in detail.splitlines()[1:] if line.strip()]
    return lines[-1][:160] if lines else ""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("modules", nargs="*", default=MODULES)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="hvd-survey-"))
    out.mkdir(parents=True, exist_ok=True)
    for spec in args.modules:
        module, _, cases = spec.partition(":")
        progress = out / module
        for rank in range(2):
            Path(f"{progress}.{rank}").unlink(missing_ok=True)
        with running_daemons(2, log_dir=out, round_timeout=ROUND_TIMEOUT_S) as daemons:
            run_workers(run_cases, 2, (daemons.addresses, f"survey-{module}",
                                       [(module, cases.split(",") if cases else None)],
                                       str(progress)),
                        timeout=3600, allow_errors=True)
        ranks = []
        for rank in range(2):
            path = Path(f"{progress}.{rank}")
            lines = path.read_text().splitlines() if path.exists() else []
            ranks.append({json.loads(line)[1]: json.loads(line) for line in lines})
        for name in ranks[0] | ranks[1]:
            outcomes = [ranks[r].get(name, [None, None, "missing", "0 s"]) for r in range(2)]
            seconds = outcomes[0][3].split(" ", 1)[0]
            bad = next((o for o in outcomes if o[2] not in ("pass", "skip")), outcomes[0])
            print(f"{module}\t{name}\t{outcomes[0][2]}/{outcomes[1][2]}\t{seconds}s\t"
                  f"{_summary(bad[3])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
