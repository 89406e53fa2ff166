"""Shared pieces of the production tests: raw Reduce streams (tests/helpers/raw_stream.py),
scrapes, unit files."""

import re
import shlex
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from raw_stream import RawStream
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT_BINARY = "/opt/reducerd/bin/reducerd"
_METRICS_RE = re.compile(r"metrics on http://(\S+)/metrics")


def shard(job, rank, world_size, numel=256, key="w", round_=0, dtype=pb.DTYPE_FLOAT16):
    wire = {pb.DTYPE_FLOAT16: "<f2", pb.DTYPE_FLOAT32: "<f4"}[dtype]
    data = np.full(numel, rank + 1, dtype=wire).tobytes()
    return pb.Shard(job=job, rank=rank, world_size=world_size, round=round_, key=key,
                    offset=0, dtype=dtype, op=pb.REDUCE_OP_SUM, data=data)


@pytest.fixture
def raw_streams():
    """Factory for RawStream; every stream is closed at the end of the test."""
    streams = []

    def open_stream(address, token=None):
        streams.append(RawStream(address, token))
        return streams[-1]

    yield open_stream
    for stream in streams:
        stream.close()


def metrics_url(daemon) -> str:
    match = _METRICS_RE.search(daemon.log())
    assert match, f"no metrics address in the log:\n{daemon.log()}"
    return f"http://{match.group(1)}/metrics"


def scrape(url: str) -> dict:
    """{(sample name, ((label, value), ...)): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return parse_exposition(text)


def parse_exposition(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def exec_start_args(unit: Path) -> list[str]:
    """The arguments of the unit's ExecStart= after the binary, specifiers left in."""
    for line in unit.read_text().splitlines():
        if line.startswith("ExecStart="):
            argv = shlex.split(line.removeprefix("ExecStart="))
            assert argv[0] == UNIT_BINARY
            return argv[1:]
    raise AssertionError(f"no ExecStart= in {unit}")
