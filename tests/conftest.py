import sys
from pathlib import Path

import pytest

# tests/helpers/support.py, importable by spawned workers too (not tests/ itself:
# tests/torch etc. would then shadow the real frameworks).
sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from support import running_daemons  # noqa: E402


@pytest.fixture
def daemons(tmp_path):
    """Factory: `with daemons(2, round_timeout=5) as d:` starts real daemons on 127.0.0.1."""
    def start(count=2, *args, round_timeout=None):
        return running_daemons(count, *args, log_dir=tmp_path, round_timeout=round_timeout)
    return start
