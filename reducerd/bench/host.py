"""What a figure was measured on and how: the CPU model, the date, the command line.

Every bench JSON carries `host_record()`, and the scripts under scripts/ that
print the CPU they ran on take it from `cpu_model()`: one reader of /proc/cpuinfo.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "command_line", "host_record"]

CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name ("AMD EPYC 9R14 96-Core Processor"), from /proc/cpuinfo.

    Where the file or its "model name" line is missing (not Linux, some ARM
    kernels) the processor platform reports, or "unknown CPU"."""
    try:
        with cpuinfo.open() as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The command as a shell would take it back: `prog` then the quoted argv."""
    return " ".join([prog, *(shlex.quote(arg) for arg in argv)])


def host_record(command: str) -> dict[str, Any]:
    """The JSON's "host": the CPU, the machine, the UTC date and the command that ran."""
    return {
        "cpu_model": cpu_model(), "cpus": os.cpu_count(), "machine": platform.machine(),
        "python": platform.python_version(), "kernel": platform.release(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
    }
