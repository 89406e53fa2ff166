import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# REDUCER_TEST_SEEDED=1 (.ci/run): every property test draws the same cases on
# every run, so CI's verdict is reproducible; runs without it explore new ones.
settings.register_profile("seeded", derandomize=True)
if os.environ.get("REDUCER_TEST_SEEDED") == "1":
    settings.load_profile("seeded")

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


def _budget_classes() -> list:
    from reducerd.core.limits import MemoryBudget, PyMemoryBudget

    return [PyMemoryBudget] + ([MemoryBudget] if MemoryBudget is not PyMemoryBudget else [])


@pytest.fixture(params=_budget_classes(), ids=lambda cls: cls.__name__)
def budget_class(request):
    """Each MemoryBudget: the Python one, and the C one where it was built."""
    return request.param


def _data_loops() -> list:
    try:
        from reducerd.dataplane import _cplane  # noqa: F401
    except ImportError:
        return ["python", pytest.param("c", marks=pytest.mark.skip("_cplane is not built"))]
    return ["python", "c"]


@pytest.fixture(params=_data_loops())
def data_loop(request, monkeypatch):
    """Each loop that reads plain-TCP data-plane frames, for the daemons a test
    starts (they inherit $REDUCERD_DATA_LOOP): the Python one and the C one."""
    monkeypatch.setenv("REDUCERD_DATA_LOOP", request.param)
    return request.param
