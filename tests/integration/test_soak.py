"""The soak script in its 15-second form (the full run is 10 minutes, by hand:
`python scripts/soak.py --duration 600`). 8 workers in two jobs, 2 daemons,
mixed sizes: no errors, every result exact."""

import importlib
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


@pytest.mark.slow
def test_soak_15_seconds(tmp_path, monkeypatch):
    # Importable by name, so the spawned workers can unpickle soak.worker.
    monkeypatch.setattr(sys, "path", [str(SCRIPT.parent), *sys.path])
    soak = importlib.import_module("soak")
    report = soak.run(duration_s=15, workers=8, daemons=2, warmup_s=5)
    print(report)
    assert report["errors"] == 0, report["error_samples"]
    assert report["rounds_completed"] > 100
    # After the warm-up every round reuses what the first ones allocated: a
    # daemon that kept anything per round would grow with the rounds.
    grown = [end - start for start, end in zip(report["daemon_rss_start_bytes"],
                                               report["daemon_rss_end_bytes"], strict=True)]
    assert max(grown) < 16 << 20, grown
