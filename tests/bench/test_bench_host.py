"""The bench's record of what it ran on: CPU model, date and command line."""

from __future__ import annotations

import datetime
import shlex
from pathlib import Path

import pytest

from reducerd.bench.cli import config_from_argv
from reducerd.bench.host import command_line, cpu_model, host_record
from reducerd.bench.train.cli import config_from_argv as train_config_from_argv

pytestmark = pytest.mark.timeout(30)


def test_cpu_model_is_the_first_model_name_line(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                       "model name\t: AMD EPYC 9R14 96-Core Processor\n\n"
                       "processor\t: 1\nmodel name\t: another\n")
    assert cpu_model(cpuinfo) == "AMD EPYC 9R14 96-Core Processor"


def test_cpu_model_without_cpuinfo_is_still_a_name(tmp_path: Path):
    assert cpu_model(tmp_path / "absent")  # platform.processor() or "unknown CPU"
    (tmp_path / "empty").write_text("processor\t: 0\n")
    assert cpu_model(tmp_path / "empty")


def test_command_line_quotes_what_a_shell_would_split():
    argv = ["--sizes", "1K,1M", "--log-dir", "/tmp/a dir"]
    line = command_line("reducerd bench", argv)
    assert shlex.split(line) == ["reducerd", "bench", *argv]


def test_host_record_dates_in_utc_now():
    record = host_record("reducerd bench --workers 2 --daemons 2")
    date = datetime.datetime.strptime(record["date"], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.UTC)
    assert abs((datetime.datetime.now(datetime.UTC) - date).total_seconds()) < 60
    assert record["command"] == "reducerd bench --workers 2 --daemons 2"
    assert record["cpu_model"] == cpu_model() and record["cpus"] >= 1


def test_both_commands_record_their_argv():
    argv = ["--workers", "2", "--daemons", "1", "--sizes", "1M"]
    assert config_from_argv(argv).command == "reducerd bench " + " ".join(argv)
    train = ["--train", "tiny", "--workers", "1,2"]
    assert train_config_from_argv(train).command == "reducerd bench " + " ".join(train)
