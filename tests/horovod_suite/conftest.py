"""The vendored Horovod files are run by test_horovod_suites.py as ranks of a
job, never collected by pytest themselves (they need two ranks at once)."""

import sys
from pathlib import Path

collect_ignore_glob = ["upstream/*"]

sys.path.insert(0, str(Path(__file__).parent))
